"""torch.compile(fullgraph=True) of a model that calls jitattn: one custom op, fake tensors."""

import functools
import re
import warnings

import pytest
import torch

import jitattn as ja
from jitattn import reference


class TinyAttention(torch.nn.Module):
    def __init__(self, variant, hq=4, hkv=2, d=64):
        super().__init__()
        self.variant, self.hq, self.hkv, self.d = variant, hq, hkv, d
        self.qkv = torch.nn.Linear(32, (hq + 2 * hkv) * d, dtype=torch.float16)

    def forward(self, x, slopes, qo_indptr, kv_indptr):
        q, k, v = self.qkv(x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = q.reshape(-1, self.hq, self.d).contiguous()
        k = k.reshape(-1, self.hkv, self.d).contiguous()
        v = v.reshape(-1, self.hkv, self.d).contiguous()
        return ja.attention(q, k, v, self.variant, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                            slopes=slopes, cap=20.0)


def test_fullgraph_compile_matches_eager():
    slopes_p = ja.tensor("slopes", ("num_qo_heads",), "float32")
    cap = ja.scalar("cap")

    def mod(score, b, h, q_idx, kv_idx):
        return cap * ja.tanh(score / cap) + slopes_p[h] * (kv_idx - q_idx)
    variant = ja.Variant("compiled", mask="causal", score_mod=mod)
    torch.manual_seed(0)
    model = TinyAttention(variant)
    x = torch.randn(23, 32, dtype=torch.float16)
    slopes = ja.alibi_slopes(4)
    indptr = torch.tensor([0, 9, 23], dtype=torch.int32)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():  # jitattn is an inference engine: no backward formula
        eager = model(x, slopes, indptr, indptr)
        out = compiled(x, slopes, indptr, indptr)
    torch.testing.assert_close(out, eager)
    with torch.no_grad():
        q, k, v = model.qkv(x).split([256, 128, 128], -1)
        ref = reference.attention(q.reshape(-1, 4, 64), k.reshape(-1, 2, 64),
                                  v.reshape(-1, 2, 64), variant, qo_indptr=indptr,
                                  kv_indptr=indptr, slopes=slopes, cap=20.0)
    torch.testing.assert_close(out, ref.half(), atol=3e-3, rtol=3e-3)


def test_the_graph_holds_one_jitattn_op():
    variant = ja.Variant("compiled_plain", mask="causal")
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def f(q, k, v):
        return ja.attention(q, k, v, variant) * 2

    q, k = torch.randn(7, 4, 64).half(), torch.randn(9, 4, 64).half()
    with torch.inference_mode():
        out = torch.compile(f, fullgraph=True, backend=recording_backend)(q, k, k)
    assert len(graphs) == 1 and graphs[0].count("jitattn.attention.default") == 1
    torch.testing.assert_close(out, ja.attention(q, k, k, variant) * 2)


def test_planned_wrappers_compile_fullgraph_and_follow_new_plans():
    """BatchDecode and SharedPrefixPrefill run() inside torch.compile(fullgraph) as one op
    per call (the variant's scalar and run()'s v_scale pass through it; SharedPrefixPrefill's
    lse too); plan() between calls changes the lengths without a recompile (same tensor
    shapes)."""
    i32 = dict(dtype=torch.int32)
    cap = ja.scalar("cap")
    variant = ja.Variant("softcap_runtime", mask="causal",
                         score_mod=lambda s, b, h, q, k: cap * ja.tanh(s / cap))
    decode = ja.BatchDecode(variant, page_size=4, device="cpu")
    shared = ja.SharedPrefixPrefill(ja.Variant("causal_sp", mask="causal"), device="cpu")
    gen = torch.Generator().manual_seed(0)
    cache = tuple(torch.randn(40, 4, 2, 64, generator=gen).half() for _ in range(2))
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def step(q, qs, ks, vs):
        out, lse = decode.run(q, cache, return_lse=True, cap=25.0, v_scale=0.5)
        shared_out, shared_lse = shared.run(qs, ks, vs, return_lse=True)
        return out * 2, lse, shared_out, shared_lse, shared.run(qs, ks, vs)

    compiled = torch.compile(step, fullgraph=True, backend=recording_backend)
    for pages, last, (prefix, suffixes) in (([2, 10, 5], [1, 4, 2], (20, [3, 5])),
                                            ([9, 1, 1], [3, 1, 4], (18, [5, 5]))):
        ids = torch.randperm(40, generator=gen)[:sum(pages)].to(torch.int32)
        decode.plan(torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], **i32), ids,
                    torch.tensor(last, **i32), 8, 2, 64)
        shared.plan(prefix, suffixes, 4, 2, 64)
        q = torch.randn(3, 8, 64, generator=gen).half()
        qs, ks, vs = (torch.randn(28, h, 64, generator=gen).half() for h in (4, 2, 2))
        with torch.inference_mode():
            got = compiled(q, qs, ks, vs)
            want = step(q, qs, ks, vs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert len(graphs) == 1 and graphs[0].count("jitattn.wrapper_run") == 3


def test_cascade_decode_compiles_fullgraph():
    i32 = dict(dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    cache = tuple(torch.randn(12, 4, 2, 64, generator=gen).half() for _ in range(2))
    q = torch.randn(3, 8, 64, generator=gen).half()
    for strategy in ("cascade", "plain"):
        cd = ja.CascadeDecode(ja.Variant("plain_cd"), page_size=4, strategy=strategy,
                              device="cpu")
        cd.plan(torch.tensor([0, 1, 2], **i32), 4, torch.tensor([0, 2, 3, 5], **i32),
                torch.tensor([3, 4, 5, 6, 7], **i32), torch.tensor([2, 1, 4], **i32), 8, 2, 64)
        with torch.inference_mode():
            got = torch.compile(lambda x: cd.run(x, cache), fullgraph=True,
                                backend="aot_eager")(q)
            torch.testing.assert_close(got, cd.run(q, cache))
            # out= is filled when traced too, and checked as in eager mode (copy_ would cast)
            out = torch.empty_like(q)
            torch.compile(lambda x, o: cd.run(x, cache, out=o), fullgraph=True,
                          backend="aot_eager")(q, out)
            torch.testing.assert_close(out, got, rtol=0, atol=0)
            with pytest.raises(Exception, match=r"out is \(3, 8, 64\) torch.float32 on cpu; "
                                                r"expected \(3, 8, 64\) torch.float16"):
                torch.compile(lambda x, o: cd.run(x, cache, out=o), fullgraph=True,
                              backend="aot_eager")(q, out.float())


def test_traced_attention_matches_eager_semantics():
    """Under torch.compile: out= / lse= are filled (they were left untouched) and checked; a
    permuted q gives a contiguous out as in eager mode (the fake kernel claimed q's strides, so
    a .view after it failed); a lone kv_indptr and an unknown parameter raise (the first was
    dropped, giving the single-request answer, the second ignored)."""
    gen = torch.Generator().manual_seed(11)
    variant = ja.Variant("traced_semantics", mask="causal")
    q = torch.randn(4, 7, 64, generator=gen).half().transpose(0, 1)  # [7, 4, 64], permuted
    k, v = (torch.randn(7, 2, 64, generator=gen).half() for _ in range(2))
    eager_o, eager_lse = ja.attention(q, k, v, variant, return_lse=True)
    compile = functools.partial(torch.compile, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        out, lse = torch.zeros_like(eager_o), torch.zeros_like(eager_lse)
        got = compile(lambda q, o, s: ja.attention(q, k, v, variant, out=o, lse=s))(q, out, lse)
        torch.testing.assert_close((got, out, lse), (eager_o, eager_o, eager_lse), rtol=0, atol=0)
        flat = compile(lambda q: ja.attention(q, k, v, variant).view(7, 256))(q)
        torch.testing.assert_close(flat, eager_o.view(7, 256), rtol=0, atol=0)
        for kwargs, text in ((dict(out=out.float()), r"out is \(7, 4, 64\) torch.float32"),
                             (dict(kv_indptr=torch.tensor([0, 7], dtype=torch.int32)),
                              "qo_indptr and kv_indptr must be given together"),
                             (dict(capp=3.0), r"unexpected parameter\(s\) \['capp'\]")):
            with pytest.raises(Exception, match=text):  # (Dynamo may wrap the error)
                compile(lambda q: ja.attention(q, k, v, variant, **kwargs))(q)


def test_a_variant_and_its_captured_tensors_are_freed_with_the_last_reference():
    """A Variant rebuilt per batch around new captured tensors (document ids, FlexAttention's
    pattern) is freed with them once the caller drops it, after eager and compiled calls (its
    torch custom op used to keep both for the life of the process); a copy has its own handle;
    a graph whose Variant is gone, or whose handle names another variant, raises instead of
    running it."""
    import copy
    import gc
    import pickle
    import weakref
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(9, 4, 64, generator=gen).half(), torch.randn(9, 2, 64, generator=gen).half()

    def document_variant(ids):
        return ja.Variant("docs", mask="causal", mask_mod=lambda b, h, qi, ki: ids[qi] == ids[ki])

    def compiled_call(variant):
        return torch.compile(lambda x: ja.attention(x, k, k, variant), fullgraph=True,
                             backend="aot_eager")(q)
    freed = []
    for step in range(3):
        doc_ids = torch.tensor([0] * (3 + step) + [1] * (6 - step), dtype=torch.int32)
        variant = document_variant(doc_ids)
        want = reference.attention(q, k, k, variant)
        with torch.inference_mode():
            torch.testing.assert_close(ja.attention(q, k, k, variant), want.half(),
                                       atol=3e-3, rtol=3e-3)
            torch.testing.assert_close(compiled_call(variant), want.half(), atol=3e-3,
                                       rtol=3e-3)
        twin = copy.copy(variant)
        assert twin._op_handle != variant._op_handle and twin.key == variant.key
        handle, key = variant._op_handle, variant.key
        freed.append(weakref.ref(doc_ids))
        del doc_ids, variant, twin, want
        torch._dynamo.reset()  # (each step's graph guards on its Variant's handle)
        gc.collect()
        assert [r() for r in freed] == [None] * len(freed)
        with pytest.raises(RuntimeError, match=f"jitattn Variant {handle} does not exist in "
                                               f"this process"):
            torch.ops.jitattn.attention(handle, key, q, k, k, None, None, 0.125, [], [])
    # a graph exported from another process names Variants by that process's handles: one
    # of another variant here is refused, not run
    other = ja.Variant("other", mask="none")
    with pytest.raises(RuntimeError, match=f"jitattn Variant {other._op_handle} is "
                                           f"'other-none-.*' in this process; the graph was traced "
                                           f"with 'docs-"):
        torch.ops.jitattn.attention(other._op_handle, key, q, k, k, None, None, 0.125, [], [])
    # an unpickled Variant (one without closures) is its own: a handle of its own, found by it
    plain = ja.Variant("pickled", mask="causal", window_left=5)
    again = pickle.loads(pickle.dumps(plain))
    assert again.key == plain.key and again._op_handle != plain._op_handle
    with torch.inference_mode():
        torch.testing.assert_close(
            torch.compile(lambda x: ja.attention(x, k, k, again), fullgraph=True,
                          backend="aot_eager")(q), ja.attention(q, k, k, plain), rtol=0, atol=0)


def test_a_wrapper_handle_is_checked_against_the_traced_class_and_variant():
    """wrapper_run names its wrapper by a handle counted per process: a graph exported from
    another process whose handle lands on a wrapper of another class or variant raises."""
    decode = ja.BatchDecode(ja.Variant("handle_decode"), page_size=4, device="cpu")
    q = torch.randn(1, 4, 64).half()
    for wrong in (f"MultiLevelCascade {decode.variant.key}", "BatchDecode other-none-0"):
        with pytest.raises(RuntimeError, match=f"jitattn wrapper {decode._handle} is "
                                               f"'BatchDecode handle_decode-.*' in this process; "
                                               f"the graph was traced with '{wrong}'"):
            torch.ops.jitattn.wrapper_run(decode._handle, wrong, q, [q], [], [], 1)


def test_an_in_place_change_of_a_captured_tensor_inside_the_graph_is_seen():
    """The ops read captured tensors through the Variant, behind the graph's back: a
    bias.fill_() the compiled function made before the attention (written back by
    functionalization only after the graph) was not seen, by ja.attention nor by a wrapper's
    run(); they are graph inputs of the ops now."""
    bias = torch.zeros(4)
    variant = ja.Variant("captured_bias", mask="causal",
                         score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h] * (kv_idx - q_idx))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=gen).half() for n, h in ((20, 4), (30, 2), (30, 2)))
    decode = ja.BatchDecode(variant, kv_layout="ragged", device="cpu")
    decode.plan(torch.tensor([0, 30], dtype=torch.int32), None, None, 4, 2, 64)

    def step(q, k, v, value):
        bias.fill_(value)
        return ja.attention(q, k, v, variant), decode.run(q[-1:], (k, v))
    with torch.inference_mode():
        bias.zero_()
        eager = step(q, k, v, 0.5)
        bias.zero_()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, 0.5)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert bias.eq(0.5).all()


def test_plan_inside_a_compiled_function_runs_eagerly():
    """plan() inside torch.compile: dynamo traced into the planner's numpy and failed with its
    own internal errors; it now runs plan() eagerly (a graph break), and with fullgraph=True
    the error names the rule."""
    variant = ja.Variant("c", mask="causal")
    decode = ja.BatchDecode(variant, page_size=16, device="cpu")
    cache = tuple(torch.randn(8, 16, 2, 64).half() for _ in range(2))
    i32 = dict(dtype=torch.int32)
    args = (torch.randn(3, 4, 64).half(), torch.tensor([0, 1, 3, 4], **i32),
            torch.tensor([0, 1, 2, 3], **i32), torch.tensor([5, 9, 16], **i32))

    def step(q, indptr, indices, last):
        decode.plan(indptr, indices, last, num_qo_heads=4, num_kv_heads=2, head_dim=64)
        return decode.run(q, cache)
    with torch.inference_mode():
        eager = step(*args)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(step, backend="aot_eager")(*args), eager,
                                   rtol=0, atol=0)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="jitattn's plan\\(\\) is host work between steps: "
                                            "call it outside the compiled function"):
            torch.compile(step, backend="aot_eager", fullgraph=True)(*args)


def test_a_captured_parameter_that_requires_grad_compiles_for_inference():
    """A score_mod capturing an nn.Parameter (a learned per-head bias), compiled with grad
    mode on and q not requiring grad: the captured tensor went into the op as it was, which
    has no autograd formula, and compiling failed."""
    bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, 4))
    variant = ja.Variant("param_bias", mask="causal",
                         score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h] * (kv_idx - q_idx))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=gen).half() for n, h in ((20, 4), (30, 2), (30, 2)))

    def attend(q, k, v):
        return ja.attention(q, k, v, variant)
    eager = attend(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_inputs_that_require_grad_compile_as_in_eager_mode():
    """q requiring grad under torch.compile: compiling failed inside torch's autograd (no
    formula for jitattn's op); now, as eagerly, the output does not track gradients, and the
    compiled call warns as the eager one does (it had dropped them in silence)."""
    variant = ja.Variant("plain", mask="causal")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, 64, generator=gen).half() for n, h in ((9, 4), (13, 2), (13, 2)))
    q.requires_grad_()

    def attend(q, k, v):
        return ja.attention(q * 1.0, k, v, variant).float().sum()
    with pytest.warns(UserWarning, match="no backward"):
        eager = attend(q, k, v)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="jitattn.attention has no backward"):
        compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
    assert not compiled.requires_grad and not eager.requires_grad
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning where grad mode is off)
        torch._dynamo.reset()
        torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
    # a planned wrapper: the same warning, naming its run()
    wrapper = ja.BatchPrefill(variant, kv_layout="ragged", device="cpu")
    indptr = torch.tensor([0, 9], dtype=torch.int32)
    wrapper.plan(indptr, torch.tensor([0, 13], dtype=torch.int32), None, None, 4, 2, 64)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="BatchPrefill.run has no backward"):
        out = torch.compile(lambda q: wrapper.run(q * 1.0, (k, v)), backend="aot_eager",
                            fullgraph=True)(q)
    assert not out.requires_grad


@pytest.mark.parametrize("reason_keyword", [True, False], ids=["torch>=2.8", "torch<2.8"])
def test_a_first_host_only_call_inside_fullgraph_gives_its_reason(monkeypatch, reason_keyword):
    """The trampoline is made at its first use; made while dynamo traced (the first plan() of
    a process inside torch.compile), fullgraph failed on torch.compiler.disable itself. And
    torch before 2.8 has no disable(reason=): the fallback dropped the reason. Both now raise
    the reason while traced (a graph break without fullgraph, after which it is made)."""
    from jitattn import args
    real = torch.compiler.disable

    def disable_without_reason(fn=None, recursive=True, **kwargs):
        if "reason" in kwargs:
            raise TypeError("disable() got an unexpected keyword argument 'reason'")
        return real(fn, recursive=recursive)
    if not reason_keyword:
        monkeypatch.setattr(torch.compiler, "disable", disable_without_reason)
    monkeypatch.setattr(args, "_HOST_ONLY", {})
    reason = "plan outside the compiled function"

    def step(x):
        args.host_only(reason)(lambda: None)
        return x + 1
    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape(reason)):
        torch.compile(step, backend="aot_eager", fullgraph=True)(torch.ones(2))
    torch._dynamo.reset()
    assert torch.compile(step, backend="aot_eager")(torch.ones(2)).eq(2).all()
    assert reason in args._HOST_ONLY  # (made eagerly after the graph break)
    if not reason_keyword:  # once made, a traced call raises the reason too
        torch._dynamo.reset()
        with pytest.raises(Exception, match=re.escape(reason)):
            torch.compile(step, backend="aot_eager", fullgraph=True)(torch.ones(2))


def test_a_bool_scale_is_refused_under_compile_as_eagerly():
    """k_scale=True became 1.0 in the op's float(): the compiled run() accepted what the eager
    one refuses."""
    i32 = dict(dtype=torch.int32)
    w = ja.BatchDecode(ja.Variant("p", mask="causal"), page_size=3, device="cpu")
    w.plan(torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32), torch.tensor([2], **i32),
           4, 2, 64)
    q, cache = torch.randn(1, 4, 64).half(), tuple(torch.randn(2, 3, 2, 64).half()
                                                  for _ in range(2))
    with pytest.raises(ValueError, match="k_scale=True: expected a finite Python float"):
        w.run(q, cache, k_scale=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: w.run(q, (k, v), k_scale=True),
                             backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="k_scale=True: expected a finite Python float"):
        compiled(q, *cache)
    torch._dynamo.reset()  # attention()'s sm_scale alike
    variant = ja.Variant("p", mask="causal")
    with pytest.raises(Exception, match="sm_scale=True: expected a finite number"):
        torch.compile(lambda q: ja.attention(q, q, q, variant, sm_scale=True),
                      backend="aot_eager", fullgraph=True)(torch.randn(3, 2, 64).half())


def test_a_variant_built_inside_a_compiled_function_is_named():
    """A Variant built while torch.compile traces: under fullgraph, dynamo's error named an
    AttributeError inside the tracer; it now says to build Variants outside. Without fullgraph
    the frame falls back to eager and matches the eager result."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(9, h, 64, generator=gen).half() for h in (4, 2, 2))

    def inside(q, k, v):
        return ja.attention(q, k, v, ja.Variant("inside", mask="causal",
                                                score_mod=ja.soft_cap(10.0)))
    with torch.inference_mode():
        eager = inside(q, k, v)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(inside, backend="aot_eager")(q, k, v), eager,
                                   rtol=0, atol=0)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="a Variant is built while torch.compile \\(or "
                                            "torch.export\\) traces, .*: build Variants and "
                                            "wrappers outside the compiled function"):
            torch.compile(inside, backend="aot_eager", fullgraph=True)(q, k, v)


def test_a_flashinfer_keyword_gets_its_hint_under_compile_too():
    """ja.attention(..., causal=True) says where causal= goes eagerly; under torch.compile the
    hint was dropped with the spelling suggestion (difflib, which dynamo cannot trace)."""
    q, k = torch.randn(8, 4, 64).half(), torch.randn(8, 2, 64).half()
    variant = ja.Variant("c", mask="causal")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"unexpected parameter\(s\) \['causal'\] .*causal= is "
                                        r"the Variant's mask"):
        torch.compile(lambda q, k, v: ja.attention(q, k, v, variant, causal=True),
                      backend="aot_eager", fullgraph=True)(q, k, k)
