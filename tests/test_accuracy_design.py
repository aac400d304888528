"""Worked examples of the three accuracy designs (../shared/design/*.md), one test each."""

from __future__ import annotations

import io

import pytest
import torch

from accuracy import (
    ComparisonResult,
    DynamicThresholdConfig,
    TensorReplacer,
    ThreeWayComparisonResult,
    align_and_truncate_hidden,
    bhattacharyya_coefficient,
    compare_tensors,
    compare_tensors_three_way,
    expand_patterns,
    hf_reference_reconstruction,
    llama_reconstruct,
    print_comparison_report,
    print_three_way_report,
)

# ----------------------------------------------------------------- prefix matching


def _replacer(prompts):
    caps = [
        {"m": [torch.arange(len(p) + 8, dtype=torch.float32)[:, None] + 100 * i]}
        for i, p in enumerate(prompts)
    ]
    return TensorReplacer(caps, prompt_token_ids=prompts)


def test_prefix_match_init_table():
    r = _replacer([[10, 20, 30], [40, 50]])
    assert r.register_request("req-abc", [10, 20, 30, 77, 88]) == 0
    assert r.register_request("req-def", [40, 50]) == 1
    assert r._resolve_prompt_idx("req-abc") == 0
    assert r._resolve_prompt_idx("req-def") == 1


def test_longest_match_wins_table():
    r = _replacer([[1, 2, 3], [1, 2, 3, 4, 5]])
    assert r.register_request("a", [1, 2, 3, 4, 5]) == 1  # [:5] wins over [:3]
    assert r.register_request("b", [1, 2, 3, 77, 88]) == 0  # retry of prompt 0
    assert r.register_request("c", [1, 2, 3, 4]) == 0  # plen 5 > 4 skipped


def test_known_corner_case_retry_reproducing_longer_prompt():
    r = _replacer([[1, 2, 3], [1, 2, 3, 4, 5]])
    # a retry of prompt 0 whose model generated [4, 5] is indistinguishable from prompt 1
    assert r.register_request("retry-of-0", [1, 2, 3, 4, 5]) == 1


def test_teacher_forcing_retry_maps_new_request_to_original_prompt():
    r = _replacer([[1, 2, 3]])
    assert r.register_request("abc-123", [1, 2, 3]) == 0
    assert r.register_request("def-456", [1, 2, 3, 77, 88]) == 0


def test_unmatched_and_unregistered_requests_raise():
    r = _replacer([[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match="match no stored prompt"):
        r.register_request("x", [9, 9, 9])
    with pytest.raises(ValueError, match="never registered"):
        r.build_context(["nobody"], [0], is_prefill=False)


# ----------------------------------------------------------------- slot tables


def _rows_replacer():
    # prompt p, position k -> value 1000 * (p + 1) + k (hand-checkable rows)
    caps = [
        {"router": [torch.tensor([[1000.0 * (p + 1) + k] for k in range(16)])[None]]}
        for p in range(2)
    ]
    r = TensorReplacer(caps, prompt_token_ids=[[7, 7], [8, 8]])
    r.register_request("r0", [7, 7])
    r.register_request("r1", [8, 8])
    return r


def test_standard_decode_slot_table():
    ctx = _rows_replacer().build_context(["r0", "r1"], [5, 3, 0, 0], is_prefill=False)
    assert ctx["router"][:, 0].tolist() == [1005.0, 2003.0, 0.0, 0.0]


def test_spec_decode_one_request_slot_table():
    ctx = _rows_replacer().build_context(["r0"], [8, 9, 10, 11], False, tokens_per_req=4)
    assert ctx["router"][:, 0].tolist() == [1008.0, 1009.0, 1010.0, 1011.0]


def test_spec_decode_two_requests_slot_table():
    ctx = _rows_replacer().build_context(
        ["r0", "r1"], [8, 9, 10, 11, 5, 6, 7, 8], False, tokens_per_req=4
    )
    assert ctx["router"][:, 0].tolist() == [1008, 1009, 1010, 1011, 2005, 2006, 2007, 2008]


def test_slots_beyond_requests_times_tokens_are_padding():
    ctx = _rows_replacer().build_context(["r0"], [8, 9, 0, 0, 0, 0], False, tokens_per_req=2)
    assert ctx["router"][:, 0].tolist() == [1008, 1009, 0, 0, 0, 0]


def test_prefill_first_duplicate_position_starts_padding():
    ctx = _rows_replacer().build_context(["r0"], [0, 1, 2, 3, 3, 3], is_prefill=True)
    assert ctx["router"][:, 0].tolist() == [1000, 1001, 1002, 1003, 0, 0]


def test_ragged_slot_table_and_explicit_padding_mask():
    r = _rows_replacer()
    ctx = r.build_context(["r0", "r1"], [4, 5, 6, 2, 3, 0, 0], False, slot_table=[(0, 3), (3, 2)])
    assert ctx["router"][:, 0].tolist() == [1004, 1005, 1006, 2002, 2003, 0, 0]
    # explicit mask: prefill whose padding repeats no position is still masked
    ctx = r.build_context(["r0"], [0, 1, 2, 3], True, padding_mask=[False, False, True, True])
    assert ctx["router"][:, 0].tolist() == [1000, 1001, 0, 0]
    with pytest.raises(ValueError, match="claimed by requests"):
        r.build_context(["r0", "r1"], [1, 2, 3], False, slot_table=[(0, 2), (1, 2)])
    with pytest.raises(ValueError, match="outside"):
        r.build_context(["r0"], [1, 2], False, slot_table=[(1, 2)])
    with pytest.raises(ValueError, match="outside the reference"):
        r.build_context(["r0"], [99], False)


def test_flatten_prefill_then_last_token_of_each_decode_step():
    # HF recompute: step 0 [1, 3, E], steps 1.. [1, 3+k, E]; only the last row is new
    s0 = torch.tensor([[[0.0], [1.0], [2.0]]])
    s1 = torch.tensor([[[-1.0], [-1.0], [-1.0], [3.0]]])
    s2 = torch.tensor([[[4.0]]])  # KV-cache style decode step
    r = TensorReplacer([{"m": [s0, s1, s2]}])
    assert r.flat[0]["m"][:, 0].tolist() == [0, 1, 2, 3, 4]
    w = r.warmup_context(num_tokens=8)
    assert w["m"].shape == (8, 1) and w["m"].abs().sum() == 0
    with pytest.raises(ValueError, match="expected 1"):
        TensorReplacer([{"m": [s0, torch.zeros(1, 7, 1)]}])


# ----------------------------------------------------------------- reconstruction


def test_llama_reconstruct_strips_bucket_padding():
    t = torch.arange(8.0)[:, None].repeat(1, 4)
    out = llama_reconstruct([t, t + 1], "model_layers_0", "prefill", [0, 1, 2, 3, 4, 4, 4, 4])
    assert out.shape == (5, 4) and out[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert llama_reconstruct([t], "x", "prefill", []) is t
    t4 = t[:4]
    masked = llama_reconstruct([t4], "x", "decode", [5, 3, 0, 0], padding_mask=[0, 0, 1, 1])
    assert masked[:, 0].tolist() == [0, 1]  # inference alone would keep only slot 0
    assert llama_reconstruct([t4], "x", "decode", [5, 3, 0, 0])[:, 0].tolist() == [0]
    with pytest.raises(ValueError, match="padding_mask has 2 slots"):
        llama_reconstruct([t4], "x", "decode", [5, 3], padding_mask=[0, 1])


def test_hf_reference_reconstruction_takes_last_token_for_decode():
    t3 = torch.arange(12.0).reshape(1, 3, 4)
    assert torch.equal(hf_reference_reconstruction([t3], "m", "decode", [0, 1, 2]), t3[:, 2:3, :])
    assert torch.equal(hf_reference_reconstruction([t3], "m", "prefill", [0, 1, 2]), t3)
    t2 = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(hf_reference_reconstruction([t2], "m", "decode", [2]), t2[2:3])


def test_align_and_truncate_hidden_batch_and_hidden_padding():
    hf = torch.randn(1, 5, 16)  # [1, seq, hidden]
    neuron = torch.cat([hf[0], torch.zeros(5, 2)], 1).to(torch.bfloat16)  # [seq, hidden + pad]
    a, b, c, ok = align_and_truncate_hidden(hf, hf, neuron)
    assert ok and a.shape == b.shape == c.shape == (5, 16)
    assert a.dtype == b.dtype == c.dtype == torch.float32
    assert torch.equal(c, neuron[:, :16].float())
    _, _, _, ok = align_and_truncate_hidden(hf, hf, torch.randn(4, 16))
    assert not ok


# ----------------------------------------------------------------- metrics


def test_compare_tensors_metric_definitions():
    ref = torch.tensor([1.0, -2.0, 4.0])
    act = torch.tensor([1.0, -2.5, 4.0])
    r = compare_tensors(ref, act, "layer_0")
    assert r.max_abs == pytest.approx(0.5)
    assert r.linf_rel == pytest.approx(0.5 / 4.0)
    assert r.l2_rel == pytest.approx(0.5 / (1 + 4 + 16) ** 0.5)
    with pytest.raises(ValueError, match="layer_0.*shape mismatch"):
        compare_tensors(ref, act[:2], "layer_0")


def test_compare_rows_equals_per_row_compare_tensors():
    from accuracy.compare import compare_rows

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 3, 7, generator=g)
    act = ref + 1e-2 * torch.randn(5, 3, 7, generator=g)
    ref[2] = 0.0  # zero reference row: inf relative error
    act[3] = ref[3]  # identical row: zeros
    rows = compare_rows(ref, act, "m")
    for i, r in enumerate(rows):
        want = compare_tensors(ref[i], act[i], f"m/token{i}")
        assert r.name == want.name and r.shape1 == want.shape1
        for f in ("linf_rel", "l2_rel", "max_abs"):
            assert getattr(r, f) == pytest.approx(getattr(want, f), rel=1e-6), (i, f)
    assert rows[2].linf_rel == float("inf") and rows[3].max_abs == 0.0


def test_compare_rows_three_way_equals_per_row():
    from accuracy.compare import compare_rows_three_way

    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 256, generator=g)
    exp = base + 1e-3 * torch.randn(4, 256, generator=g)
    act = base + 1.3e-3 * torch.randn(4, 256, generator=g)
    act[1] = base[1] + 5e-3 * torch.randn(256, generator=g)
    exp[2], act[2] = base[2], base[2]
    rows = compare_rows_three_way(base, exp, act, "m")
    for i, r in enumerate(rows):
        w = compare_tensors_three_way(base[i], exp[i], act[i], f"m/token{i}")
        assert (r.name, r.passed) == (w.name, w.passed)
        for f in ("base_linf", "tgt_linf", "base_l2", "tgt_l2", "linf_ratio", "l2_ratio", "bc"):
            assert getattr(r, f) == pytest.approx(getattr(w, f), rel=1e-6, abs=1e-9), (i, f)
    assert not rows[1].passed and rows[2].linf_ratio == 0.0 and rows[2].bc == 1.0


def test_three_way_ratios():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=g)
    noise = torch.randn(4096, generator=g) * 1e-3
    same = compare_tensors_three_way(base, base + noise, base + noise, "l0")
    assert same.linf_ratio == pytest.approx(1.0) and same.l2_ratio == pytest.approx(1.0)
    assert same.bc == pytest.approx(1.0) and same.passed
    double = compare_tensors_three_way(base, base + noise, base + 2 * noise, "l0")
    assert double.linf_ratio == pytest.approx(2.0, rel=1e-5)
    assert double.l2_ratio == pytest.approx(2.0, rel=1e-5)
    assert not double.passed and double.bc < 0.9
    mild = compare_tensors_three_way(base, base + noise, base + 1.2 * noise, "l0")
    assert mild.passed and mild.linf_ratio == pytest.approx(1.2, rel=1e-5)
    loose = DynamicThresholdConfig(linf_multiplier=2.5, l2_multiplier=2.5)
    assert compare_tensors_three_way(base, base + noise, base + 2 * noise, "l0", loose).passed
    zero = compare_tensors_three_way(base, base, base, "embed")
    assert (zero.linf_ratio, zero.l2_ratio, zero.bc, zero.passed) == (0.0, 0.0, 1.0, True)


def test_bhattacharyya_coefficient_extremes():
    a = torch.rand(10000, generator=torch.Generator().manual_seed(1))
    assert bhattacharyya_coefficient(a, a) == pytest.approx(1.0)
    assert bhattacharyya_coefficient(a, a + 5.0) == pytest.approx(0.0)
    # two point masses in the end bins of 100 over [0, 1]: no overlap; half overlap
    p = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert bhattacharyya_coefficient(p, torch.tensor([1.0, 1.0, 1.0, 1.0])) == pytest.approx(
        0.5**0.5
    )
    assert bhattacharyya_coefficient(torch.zeros(3), torch.zeros(5)) == 1.0
    assert bhattacharyya_coefficient(torch.tensor([float("nan")]), p) != bhattacharyya_coefficient(
        torch.tensor([float("nan")]), p
    )  # NaN: no finite errors on one side


# ----------------------------------------------------------------- patterns


def test_expand_patterns_ranges():
    assert expand_patterns(["model.layers.0-2", "lm_head"]) == [
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "lm_head",
    ]
    assert expand_patterns(["model.layers.0-1.self_attn"]) == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    assert len(expand_patterns(["model.layers.0-31"])) == 32
    assert expand_patterns([r"model\.layers\.\d+", ".*self_attn$"]) == [
        r"model\.layers\.\d+",
        ".*self_attn$",
    ]


@pytest.mark.parametrize("bad", ["model.layers.5-2", "model.layers.0-", "model.layers.-3", "a.1-x"])
def test_malformed_range_raises(bad):
    with pytest.raises(ValueError, match="malformed range"):
        expand_patterns([bad])


# ----------------------------------------------------------------- report formats

TWO_WAY = """\
TENSOR COMPARISON: HF FP32 vs Neuron
================================================================================
Threshold: L-inf > 0.01 highlighted in red

=== prompt_0 ===

--- Step 0 ---
Module                                               L-inf           L2      Max Abs
--------------------------------------------------------------------------------
model_embed_tokens/token0                         0.00e+00     0.00e+00     0.00e+00
model_layers_0_input_layernorm/token0             2.76e-03     1.95e-03     3.09e-02
model_layers_0_self_attn/token0                   3.52e-03     2.14e-03     5.21e-02
model_layers_0_mlp/token0                         4.18e-03     3.01e-03     7.83e-02
lm_head                                           3.78e-01     4.33e-01     4.86e+00

SUMMARY: 1 deviation(s) > 0.01, 0 shape mismatch(es)
"""

THREE_WAY = """\
THREE-WAY COMPARISON: HF BF16 & Neuron vs FP32
==========================================================================================
Ratio = Tgt/Base error. Red if ratio >= 1.5x

=== prompt_0 ===

--- Step 0 ---
Module                                    L-inf Ratio     L2 Ratio       BC
------------------------------------------------------------------------------------------
model_embed_tokens/token0                      0.0000       0.0000   1.0000
model_layers_0_input_layernorm/token0          1.0000       1.0000   1.0000
model_layers_0_self_attn/token0                1.0312       1.0099   0.9993
model_layers_0_mlp/token0                      0.8904       1.0694   0.9990
lm_head                                        1.1419       1.2111   0.9842

SUMMARY: 0 failure(s) (ratio >= 1.5x), 0 shape mismatch(es)
"""


def test_two_way_report_format():
    rows = [
        ("model_embed_tokens/token0", 0.0, 0.0, 0.0),
        ("model_layers_0_input_layernorm/token0", 2.76e-3, 1.95e-3, 3.09e-2),
        ("model_layers_0_self_attn/token0", 3.52e-3, 2.14e-3, 5.21e-2),
        ("model_layers_0_mlp/token0", 4.18e-3, 3.01e-3, 7.83e-2),
        ("lm_head", 3.78e-1, 4.33e-1, 4.86),
    ]
    results = {"prompt_0": {0: [ComparisonResult(*r) for r in rows]}}
    buf = io.StringIO()
    s = print_comparison_report(
        results, label1="HF FP32", label2="Neuron", file=buf, colorize=False
    )
    # The design's sample says "2 deviation(s)" although only lm_head exceeds 0.01;
    # the row values are the design's, the count is the true one.
    assert buf.getvalue() == TWO_WAY
    assert (s.failures, s.shape_mismatches, s.first_failure) == (1, 0, ("prompt_0", 0, "lm_head"))
    buf = io.StringIO()
    print_comparison_report(results, label1="A", label2="B", file=buf, colorize=True)
    assert "\033[91mlm_head" in buf.getvalue()


def test_three_way_report_format():
    rows = [
        ("model_embed_tokens/token0", 0.0, 0.0, 1.0),
        ("model_layers_0_input_layernorm/token0", 1.0, 1.0, 1.0),
        ("model_layers_0_self_attn/token0", 1.0312, 1.0099, 0.9993),
        ("model_layers_0_mlp/token0", 0.8904, 1.0694, 0.9990),
        ("lm_head", 1.1419, 1.2111, 0.9842),
    ]
    results = {
        "prompt_0": {
            0: [
                ThreeWayComparisonResult(n, linf_ratio=a, l2_ratio=b, bc=c, passed=True)
                for n, a, b, c in rows
            ]
        }
    }
    buf = io.StringIO()
    s = print_three_way_report(results, label_expected="HF BF16", file=buf, colorize=False)
    assert buf.getvalue() == THREE_WAY
    assert s.ok


# ----------------------------------------------------------------- decode alignment


def _fwd(dir_name, positions, req="r", t=None):
    from accuracy import CapturedForwardPass, ForwardPassMetadata

    t = torch.zeros(len(positions), 4) if t is None else t
    return CapturedForwardPass(dir_name, ForwardPassMetadata([req], positions), {"m": {0: t}})


def test_align_decode_captures_keeps_ref_steps_with_matching_positions():
    from accuracy import align_decode_captures

    # HF recomputes the whole sequence each step: max position 6, 7, 8, 9 (given unsorted)
    ref = [_fwd("prefill_s6_0", list(range(6)))] + [
        _fwd(f"decode_b{p + 1}_0", list(range(p + 1))) for p in (8, 6, 9, 7)
    ]
    # the target batched differently and only has positions 7 and 9 (padded slots at 0)
    tgt = [
        _fwd("prefill_s8_0", list(range(6)) + [5, 5]),
        _fwd("decode_b4_0", [7, 0, 0, 0]),
        _fwd("decode_b4_1", [9, 0, 0, 0]),
    ]
    out = align_decode_captures(ref, tgt)
    assert [f.dir_name for f in out] == ["prefill_s6_0", "decode_b8_0", "decode_b10_0"]


def test_capture_level_shape_mismatch_recorded_or_raised():
    from accuracy import compare_captures_two_way

    ref = [_fwd("prefill_s3_0", [0, 1, 2])]
    test = [_fwd("prefill_s3_0", [0, 1, 2], t=torch.zeros(2, 4))]
    res = compare_captures_two_way(ref, test)
    (r,) = res["prompt_0"][0]
    assert not r.shape_match and r.shape1 == (3, 4) and r.shape2 == (2, 4)
    buf = io.StringIO()
    s = print_comparison_report(res, file=buf, colorize=False)
    assert s.shape_mismatches == 1 and "SHAPE MISMATCH [3, 4] vs [2, 4]" in buf.getvalue()
    with pytest.raises(ValueError, match=r"'m': shape mismatch \[3, 4\] vs \[2, 4\]"):
        compare_captures_two_way(ref, test, strict=True)


def test_unpaired_steps_and_prompts_are_reported_missing():
    from accuracy import compare_captures_three_way, compare_captures_two_way

    ref = [_fwd("prefill_s3_0", [0, 1, 2]), _fwd("decode_b1_0", [3]), _fwd("decode_b1_1", [4])]
    ref += [_fwd("prefill_s2_0", [0, 1], req="other")]
    test = [_fwd("prefill_s3_0", [0, 1, 2]), _fwd("decode_b1_0", [3])]
    res = compare_captures_two_way(ref, test)
    assert res["prompt_0"][2][0].missing == "test" and "decode_b1_1" in res["prompt_0"][2][0].name
    assert res["prompt_1"][0][0].missing == "test"
    buf = io.StringIO()
    s = print_comparison_report(res, file=buf, colorize=False)
    assert s.missing == 2 and not s.ok and "2 missing module(s)/step(s)" in buf.getvalue()
    three = compare_captures_three_way(ref, ref, test)
    assert three["prompt_0"][2][0].missing == "actual"
