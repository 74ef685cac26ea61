"""The timing helpers that need no GPU: how many weight copies the rotating-weights protocol uses."""
import pytest

from sparseforge.runtime.timing import MAX_WEIGHT_COPIES, ROTATE_L2_MULTIPLE, weight_copies

L2 = 60 << 20


@pytest.mark.parametrize("weight_bytes", [1, 4096, 6 << 20, 33_554_432, 60 << 20, 117 << 20, 1 << 31])
def test_copies_together_exceed_the_l2_twice_and_are_never_one(weight_bytes):
    copies = weight_copies(weight_bytes, L2)
    assert copies >= 2  # the previous call's copy is never the next one's
    if copies < MAX_WEIGHT_COPIES:
        assert copies * weight_bytes >= ROTATE_L2_MULTIPLE * L2
        assert copies == 2 or (copies - 1) * weight_bytes < ROTATE_L2_MULTIPLE * L2  # no more than needed


def test_a_dense_llama_weight_needs_four_copies_and_a_90_percent_one_twenty():
    assert weight_copies(4096 * 4096 * 2, L2) == 4          # dense fp16 4096 x 4096: 33.5 MB
    assert weight_copies(4096 * 4096 // 10 * 4, L2) == 19   # 90% with 16-bit index + fp16 value: 6.7 MB


def test_tiny_weights_are_capped_and_empty_ones_still_rotate():
    assert weight_copies(16, L2) == MAX_WEIGHT_COPIES
    assert weight_copies(0, L2) == 2
