"""The tap convention and its converters to DFlash/DSpark, SGLang-native and vLLM layer ids."""

import pytest

from draftsmith.engines import taps

pytestmark = pytest.mark.unit


def test_sglang_native_ids_are_ours_minus_one_both_ways():
    assert taps.taps_to_sglang_aux_layer_ids([2, 46, 90], 94) == [1, 45, 89]
    assert taps.taps_from_sglang_aux_layer_ids([1, 45, 89], 94) == [2, 46, 90]


def test_dflash_target_layer_ids_are_ours_minus_one_both_ways():
    # vLLM's reference DFlash config: target_layer_ids [1, 14, 26] read as aux ids [2, 15, 27].
    assert taps.taps_from_dflash_target_layer_ids([1, 14, 26], 30) == [2, 15, 27]
    assert taps.taps_to_dflash_target_layer_ids([2, 15, 27], 30) == [1, 14, 26]


def test_vllm_aux_ids_are_our_taps():
    assert taps.taps_to_vllm_aux_ids([2, 15, 27], 30) == [2, 15, 27]
    assert taps.taps_from_vllm_aux_ids((2, 15, 27), 30) == [2, 15, 27]


def test_round_trips_cover_the_whole_valid_range():
    layers = 5
    every = list(range(1, layers))
    assert taps.taps_from_dflash_target_layer_ids(taps.taps_to_dflash_target_layer_ids(every, layers), layers) == every
    assert taps.taps_from_sglang_aux_layer_ids(taps.taps_to_sglang_aux_layer_ids(every, layers), layers) == every


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([0, 2], r"^hidden_states\.taps\[0\] = 0: outside 1\.\.3 for a 4-layer target"),
        ([1, 4], r"^hidden_states\.taps\[1\] = 4: outside 1\.\.3"),
        ([2, 1], r"^hidden_states\.taps: \[2, 1\] must be strictly ascending"),
        ([2, 2], r"^hidden_states\.taps: \[2, 2\] must be strictly ascending"),
        ([], r"^hidden_states\.taps: at least one tap"),
        ([1.0], r"^hidden_states\.taps\[0\] = 1\.0: a tap must be an integer"),
        ([True], r"^hidden_states\.taps\[0\] = True: a tap must be an integer"),
    ],
)
def test_bad_taps_name_the_field_and_entry(value, message):
    with pytest.raises(ValueError, match=message):
        taps.validate_taps(value, 4)


def test_zero_based_ids_are_checked_against_the_layer_count():
    with pytest.raises(ValueError, match=r"^dflash_config\.target_layer_ids\[2\] = 3: outside 0\.\.2 for a 4-layer"):
        taps.taps_from_dflash_target_layer_ids([0, 1, 3], 4)
    with pytest.raises(ValueError, match=r"^sglang\.aux_hidden_states_layers\[0\] = -1: outside 0\.\.2"):
        taps.taps_from_sglang_aux_layer_ids([-1], 4)
    with pytest.raises(ValueError, match=r"^dspark\.target_layer_ids: \[2, 1\] must be strictly ascending"):
        taps.taps_from_dflash_target_layer_ids([1, 0], 4, field="dspark.target_layer_ids")
    with pytest.raises(ValueError, match=r"^hidden_states\.taps\[0\] = 4: outside 1\.\.3"):
        taps.taps_to_sglang_aux_layer_ids([4], 4)


def test_a_one_layer_target_has_no_taps():
    with pytest.raises(ValueError, match=r"^hidden_states\.taps: a target needs at least 2 decoder layers"):
        taps.validate_taps([1], 1)
