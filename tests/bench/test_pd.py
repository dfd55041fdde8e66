"""`swallow bench pd`'s parts that run without a stack: the planned transfer
of the MiMo-V2.5-Pro shape, and the transports' bandwidth against a raw copy."""

from __future__ import annotations

from bench.pd import _latency_figures, pro_transfer_ratios, transport_bandwidth


def test_the_pro_shape_sends_about_a_seventh_of_full_attention_kv_at_128k() -> None:
    ratios = pro_transfer_ratios()
    assert 0.12 < ratios["128k"]["ratio"] < ratios["32k"]["ratio"] < 0.2
    assert ratios["128k"]["bytes"] < ratios["128k"]["full_attention_bytes"]
    assert ratios["128k"]["swa_window_tokens"] < 256


def test_each_transport_moves_its_bytes_and_is_compared_with_a_raw_copy() -> None:
    sizes = (1 << 20, 4 << 20)
    result = transport_bandwidth(sizes, repeats=2)
    for name in ("raw_copy", "shm", "torch"):
        assert set(result[name]) == {str(n) for n in sizes}
        for row in result[name].values():
            assert row["seconds"] > 0 and row["gb_per_s"] > 0
    assert all(0 < row["of_raw_copy"] for row in result["shm"].values())


def test_latency_figures_are_percentiles_of_the_gaps() -> None:
    figures = _latency_figures([0.01] * 89 + [0.5] * 11)
    assert figures["itl_p50_s"] == 0.01 and figures["itl_p90_s"] > 0.01 and figures["gaps"] == 100
