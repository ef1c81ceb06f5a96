"""The compute floor of each class's P99 (gpuservd/bench/compute_floor.py): which FLOPs it counts, the
burst bound on order statistics, the dtypes it can bound, and the report's line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpuservd.bench.compute_floor import (class_p99_floor, dtype_factor, floor_lines, percentile_floor,
                                          request_flops, unshared_prompt_tokens)
from gpuservd.bench.floor import decode_params, weight_bytes_per_decode_step
from gpuservd.bench.fma_peak import NoCompiler

CONFIG = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
          "num_hidden_layers": 2, "vocab_size": 100}


def test_a_prompt_counts_only_the_tokens_no_other_prompt_shares():
    prompts = [[1, 2, 3, 4], [1, 2, 9], [5, 6], [1, 2, 3, 4, 5], [7]]
    # [1,2,3,4] is all inside [1,2,3,4,5]; [1,2,9] shares [1,2]; [5,6] and [7] share nothing
    assert unshared_prompt_tokens(prompts) == [0, 1, 2, 1, 1]
    assert unshared_prompt_tokens([[3, 3], [3, 3]]) == [0, 0]  # duplicates: either may be the cached one
    assert unshared_prompt_tokens([]) == []


def test_a_request_pays_its_layers_and_lm_head():
    layers, head = decode_params(CONFIG, biases=False)
    # q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16, two layers; the LM head 100 x 8
    assert (layers, head) == (2 * (64 + 32 + 32 + 64 + 3 * 128), 800)
    # 5 unshared prompt tokens and 3 outputs: 5 + 2 tokens through the layers, 3 through the head
    assert request_flops(5, 3, layers, head) == 2.0 * (7 * layers + 3 * head)
    assert request_flops(0, 0, layers, head) == 2.0 * head  # one token is sampled at least
    # biases are additions, not multiply-adds: the bytes count them, the floor does not
    biased = dict(CONFIG, attention_bias=True)
    assert decode_params(biased, biases=False) == decode_params(CONFIG, biases=False)
    assert weight_bytes_per_decode_step(biased, 1) > weight_bytes_per_decode_step(CONFIG, 1)


def test_in_a_burst_the_kth_to_finish_waits_for_the_k_smallest():
    works = [4.0, 1.0, 2.0, 3.0]  # FLOPs; a peak of 1 FLOP/s makes seconds of them
    # sorted 1 2 3 4: order-statistic bounds max(own, cumulative) = 1 3 6 10
    for q in (0, 50, 99, 100):
        want = np.percentile([1, 3, 6, 10], q, method="linear")
        assert percentile_floor(works, 1.0, burst=True, q=q) == pytest.approx(want)
    # not a burst: only each request's own work
    assert percentile_floor(works, 1.0, burst=False, q=99) == pytest.approx(np.percentile(works, 99))
    assert percentile_floor(works, 2.0, burst=True, q=100) == pytest.approx(5.0)
    assert percentile_floor([7.0], 1.0, burst=True) == pytest.approx(7.0)


def test_the_floor_is_below_every_schedule_of_a_burst():
    rng = np.random.default_rng(0)
    works = list(rng.uniform(1, 10, size=40))
    floor = percentile_floor(works, 1.0, burst=True)
    # any order on one machine at the peak rate: completions are prefix sums of that order
    for _ in range(200):
        done = np.cumsum(rng.permutation(works))
        assert np.percentile(done, 99, method="linear") >= floor - 1e-9
    best = np.cumsum(sorted(works))  # shortest first on the machine is the floor itself
    assert np.percentile(best, 99, method="linear") == pytest.approx(floor)


def test_dtypes_the_probe_can_bound():
    assert dtype_factor("float32", {"avx2", "fma"})[0] == 1.0
    assert dtype_factor("bfloat16", {"avx2", "fma"})[0] == 1.0  # converted to fp32 for its FMAs
    assert dtype_factor("bfloat16", {"avx512f", "avx512_bf16"})[0] == 2.0
    assert dtype_factor("float16", {"avx512f", "avx512_fp16"})[0] == 2.0
    factor, why = dtype_factor("bfloat16", {"avx512_bf16", "amx_bf16"})
    assert factor is None and "AMX" in why
    assert dtype_factor("float32", {"amx_bf16"})[0] == 1.0  # AMX multiplies no fp32


def _req(cls, prompt, out, arrival=0.0):
    return SimpleNamespace(cls=cls, prompt_token_ids=prompt, output_tokens=out, arrival_s=arrival)


def test_class_floors_from_requests():
    reqs = [_req("short", [1, 2, 3], 2), _req("short", [4, 5], 3), _req("long", [6], 10, arrival=1.0)]
    layers, head = decode_params(CONFIG, biases=False)
    fl = class_p99_floor(reqs, CONFIG, "float32", measure_peak=lambda threads: 1e-9 * threads, cores=2,
                         flags={"avx2", "fma"})
    assert fl["fma_peak_gflops"] == pytest.approx(2e-9) and fl["dtype_factor"] == 1.0
    peak = 2.0  # FLOP/s
    w = sorted([request_flops(3, 2, layers, head), request_flops(2, 3, layers, head)])
    short = fl["classes"]["short"]
    assert short["burst"] and short["n"] == 2
    assert short["p99_floor_s"] == pytest.approx((w[0] + 0.99 * (sum(w) - w[0])) / peak)
    long = fl["classes"]["long"]
    assert not long["burst"] and long["p99_floor_s"] == pytest.approx(request_flops(1, 10, layers, head) / peak)
    skipped = class_p99_floor(reqs, CONFIG, "bfloat16", measure_peak=lambda t: 1.0, flags={"amx_bf16"})
    assert "AMX" in skipped["skipped"]


def test_the_report_line_gives_each_system_over_the_floor():
    result = {"floor": {"class_p99": {"fma_peak_gflops": 184.0, "cores": 2, "dtype_factor": 1.0, "peak_note": "fp32",
                                      "classes": {"short": {"p99_floor_s": 5.0}, "long": {"p99_floor_s": 10.0}}}},
              "systems": {"gpuserv": {"latency_s": {"short": {"p99": 10.0}, "long": {"p99": 30.0}}},
                          "vllm_cpu": {"latency_s": {"short": {"p99": 20.0}}}}}
    text = "\n".join(floor_lines(result))
    assert "short 5.00 s (gpuserv 2.00x, vllm_cpu 4.00x)" in text
    assert "long 10.00 s (gpuserv 3.00x)" in text
    assert "184 GFLOP/s on 2 cores" in text and "Below the floor" not in text
    result["systems"]["gpuserv"]["latency_s"]["short"]["p99"] = 4.0
    assert "Below the floor: gpuserv (short)" in "\n".join(floor_lines(result))
    assert "not computed (no compiler)" in "\n".join(floor_lines({"floor": {"class_p99": {"skipped": "no compiler"}}}))
    assert floor_lines({"floor": None}) == [] and floor_lines({}) == []


def test_no_probe_no_floor_with_the_reason():
    def no_compiler(threads):
        raise NoCompiler("no C++ compiler (c++ or g++) on PATH")

    fl = class_p99_floor([_req("short", [1], 1)], CONFIG, "float32", measure_peak=no_compiler, cores=1, flags=set())
    assert fl == {"skipped": "the FMA probe could not run: no C++ compiler (c++ or g++) on PATH"}
