"""`make bench` cannot rot unseen: ``python -m loadtests.bench --smoke`` runs every section (tiny
models, windows of a fraction of a second) and must exit 0 with one JSON object on its last line
carrying every key the README and the issue quote, each a number. No timing is asserted: the
figures of a smoke run mean nothing. About 50 s on 2 shared cores; longer when the peers
(LitServe, Ray Serve) are importable, since they then run too.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)

KEYS = (
    # decode, zeroshot, layers
    "draft_decode_speedup", "draft_top1_agreement", "draft_top1_full", "draft_top1_draft", "zero_shot_cache_speedup",
    "fused_vs_reference_ort_b8",
    # serving
    "batching_vs_b1", "strict_determinism_cost", "strict_saturation_ratio", "strict_c1_p50_ratio",
    "strict_fullpad_c1_p50_ratio", "e2e_vs_raw", "e2e_over_raw",
    # frontend
    "frontend_rps_1", "frontend_rps_per_core", "frontend_scaling", "frontend_scaling_per_process", "frontend_room",
    "frontend_img_per_s_1",
    # the batch-invariant layer forms (torch, CPU)
    "invariance_strict_c1_speedup", "invariance_b1_cost", "invariance_b8_cost",
    # --decode-nice 10 vs 0
    "decode_nice_throughput_ratio", "decode_nice_c1_p50_ratio",
    # bounded request heads vs uvicorn's httptools
    "protocol_added_us_per_request", "protocol_bounded_over_httptools",
    # legitimate traffic with and without slow clients attacking
    "attack_throughput_ratio", "attack_errors", "attack_clients_cut",
    # --concurrent-batches 2 vs 1
    "concurrent_batches_throughput_ratio", "concurrent_batches_c1_p50_ratio",
    # --ort-spinning run vs off: the backend alone, then serving
    "spin_backend_b1_speedup", "spin_backend_bmax_speedup", "spin_saturation_ratio", "spin_c1_p50_ratio",
    # resident memory of the server's processes over the weights' bytes
    "rss_over_weights", "rss_over_weights_first", "rss_over_weights_cached", "one_session_cost_b1",
    "one_session_cost_b8",
    # routing statistics on vs off
    "routing_stats_on_vs_off", "routing_stats_on_vs_off_paired", "routing_stats_every_call_vs_off",
    # OIP over gRPC vs over HTTP with JSON data and with binary tensors (one and eight rows per request)
    "grpc_over_http_json", "grpc_over_http_binary", "grpc_over_http_json_b8", "grpc_over_http_binary_b8",
    "oip_grpc_img_per_s_b1", "oip_http_json_img_per_s_b1", "oip_http_binary_img_per_s_b1",
    "oip_grpc_img_per_s_b8", "oip_http_json_img_per_s_b8", "oip_http_binary_img_per_s_b8",
    "oip_grpc_server_cpu_ms_per_img_b1", "oip_http_json_server_cpu_ms_per_img_b1",
    "oip_http_binary_server_cpu_ms_per_img_b1",
    # the OIP answer's encoding in the postprocess stage, per wire, 1 and 32 rows
    *(f"oip_{kind}_ms_{wire}_r{rows}" for kind in ("encode", "round_trip") for wire in ("http_json", "http_binary", "grpc")
      for rows in (1, 32)),
    # sparse V-MoE (Tokens Choice K=1, K=2, Experts Choice at capacity factors 4.0 and 1.05) served
    # beside Soft MoE; expert rows per image and MoE block; Tokens Choice's routed vs capacity form
    *(f"sparse_{k}_{key}" for k in ("tc", "tc_k2", "ec", "tc_cf105", "tc_k2_cf105", "ec_cf105")
      for key in ("over_soft_img_s", "over_soft_c1_p50", "img_s", "c1_p50_ms", "rows_per_image")),
    "sparse_soft_img_s", "sparse_soft_c1_p50_ms", "sparse_soft_rows_per_image", "sparse_tc_capacity_rows_per_image",
    "sparse_tc_routed_over_capacity_img_s", "sparse_tc_routed_over_capacity_b1", "sparse_tc_routed_img_s",
    "sparse_tc_capacity_img_s", "sparse_tc_routed_b1_ms", "sparse_tc_capacity_b1_ms", "sparse_tc_forms_max_abs_diff",
    # softmoe embed over JPEG files vs the raw backend
    "embed_over_raw", "embed_img_per_s", "embed_raw_img_per_s",
    # a model reloaded while it serves: failures, p99 during over steady, memory after an unload
    "swap_failures", "swap_p99_over_steady", "swap_rss_growth_over_weights", "swap_sat_img_s", "swap_reload_s",
    # then new weights loaded again and again under 8 clients into a small cache: its bytes over one entry's
    "cache_bytes_after_50_loads", "cache_cap_over_entry", "cache_max_bytes_over_cap", "cache_load_failures",
    "cache_client_errors",
    # --otlp-endpoint at 10% sampling vs off, side by side
    "tracing_overhead", "tracing_c1_p50_ratio", "tracing_img_per_s_on", "tracing_img_per_s_off",
    # time to ready: nothing cached, prepared ahead, other weights loaded idle and under clients; disk
    "coldstart_read_s", "coldstart_first_s", "coldstart_prepare_s", "coldstart_prepared_s",
    "coldstart_prepared_over_read", "reload_new_weights_s", "reload_new_weights_loaded_s",
    "reload_new_weights_failures", "reload_new_weights_digits_s", "disk_over_weights", "prepared_anon_over_weights",
    # the run
    "errors", "seconds",
)


@pytest.fixture(scope="module")
def smoke() -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run([sys.executable, "-m", "loadtests.bench", "--smoke"], cwd=ROOT, capture_output=True, text=True,
                       timeout=540, env={**os.environ, "MPLBACKEND": "Agg"})
    lines = r.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    return r, result


def test_exits_zero_with_one_json_line(smoke):
    r, result = smoke
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert isinstance(result, dict), f"last line is not a JSON object: {r.stdout.strip().splitlines()[-1:]}"
    assert result["mode"] == "smoke"
    assert result["command"] == "python -m loadtests.bench --smoke"


def test_every_key_is_a_number(smoke):
    _, result = smoke
    assert result is not None, "no JSON line (see test_exits_zero_with_one_json_line)"
    missing = [k for k in KEYS if k not in result]
    assert not missing, f"keys missing from the final JSON: {missing}"
    for k in KEYS:
        v = result[k]
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), f"{k} = {v!r}"


def test_every_request_succeeded(smoke):
    _, result = smoke
    assert result["errors"] == 0


def test_gpu_section_reports_without_crashing(smoke):
    _, result = smoke
    assert isinstance(result["gpu"], str)  # "not available" on CPU, "skipped (--smoke)" on a GPU machine


def test_peers_report_every_ratio_or_are_skipped(smoke):
    r, result = smoke
    ran = [] if result["peers"] == "none installed" else result["peers"].split(",")
    if not ran:
        assert "skipped" in r.stdout
    for name in ran:
        for key in (f"peer_{name}_throughput_ratio", f"peer_{name}_c1_p50_ratio", f"peer_{name}_c1_p99_ratio",
                    f"peer_{name}_cpu_per_request_ratio"):
            v = result.get(key)
            assert isinstance(v, (int, float)) and math.isfinite(v), f"{key} = {v!r}"
        for stem in ("throughput", "c1_p50"):
            ahead = result.get(f"peer_{name}_{stem}_rounds_ahead")
            assert isinstance(ahead, int) and 0 <= ahead <= result["peers_rounds"]
            assert result.get(f"peer_{name}_{stem}_verdict") in ("ahead", "tie", "behind")
    strays = [k for k in result if k.startswith("peer_") and not any(k.startswith(f"peer_{n}_") for n in ran)]
    assert not strays



def test_spinning_section_compares_the_bits_of_both_policies(smoke):
    _, result = smoke
    assert result["spin_outputs_bitwise_equal"] is True


def test_grpc_section_compares_the_bits_of_every_transport(smoke):
    _, result = smoke
    assert result["grpc_outputs_bitwise_equal"] is True


def test_the_bounded_cache_takes_every_load_and_stays_under_its_cap(smoke):
    _, result = smoke
    assert result["cache_load_failures"] == 0 and result["cache_client_errors"] == 0
    assert result["cache_max_bytes_over_cap"] <= 1.0
    assert result["cache_bytes_after_50_loads"] <= result["cache_cap_over_entry"]
