import pytest

from quant.kv import kv_bytes_per_element, kv_cache_bytes

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("cache_type", "mib"),
    # Measured from llama.cpp's own allocation for SmolLM2-135M at n_ctx 4096 (shared/notes).
    [("f16", 90.00), ("q8_0", 47.8125), ("q4_0", 25.3125)],
)
def test_smollm2_kv_sizes_match_llama_cpp(cache_type, mib):
    assert kv_cache_bytes(30, 3, 64, 4096, cache_type) / MIB == pytest.approx(mib, abs=0.01)


def test_mixed_k_and_v_types_and_per_layer_heads():
    one_layer = 2 * 64 * 1024  # heads x head_dim x ctx
    expected = int(one_layer * 2 + one_layer * kv_bytes_per_element("q8_0"))
    assert kv_cache_bytes(1, 2, 64, 1024, "f16", "q8_0") == expected
    assert kv_cache_bytes(2, [1, 3], 64, 16) == (1 + 3) * 64 * 16 * 2 * 2


def test_unknown_type_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="known: f32, f16"):
        kv_bytes_per_element("q3_k")
