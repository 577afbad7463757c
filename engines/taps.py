"""The one tap convention of draftsmith, and explicit converters to the others in use.

**Tap k** is the residual stream after decoder layer k, counting from 1. It equals:

- HF `output_hidden_states=True` `hidden_states[k]` (index 0 is the embedding output);
- vLLM's and TokenSpeed's EAGLE-3 `eagle_aux_hidden_state_layer_ids` entry k (they record the input of
  0-based layer k, which is the output of layer k counting from 1), so no conversion is needed there.

Valid taps are 1..L-1 for an L-layer target. Tap L would be the pre-norm last hidden state: vLLM's layer loop
never reaches aux id L, and the last hidden state has its own setting (`hidden_states.last_hidden`).

Other conventions are 0-based layer indices of the layer whose *output* is taken, so they are ours minus one:

- DFlash/DSpark `target_layer_ids` (vLLM adds 1 when it reads them): ours = id + 1.
- SGLang-native loaders' aux layer ids: ours [2, 46, 90] are SGLang's [1, 45, 89].

Every converter checks its input against the layer count and names the offending field and entry.
"""

from collections.abc import Sequence

TAP_CONVENTION = "residual stream after decoder layer k, counting from 1 (HF hidden_states[k], vLLM EAGLE-3 aux id k)"


def validate_taps(taps: Sequence[int], num_layers: int, *, field: str = "hidden_states.taps") -> list[int]:
    """Taps as a list, checked: integers in 1..num_layers-1, strictly ascending. Errors start with `field`."""
    if num_layers < 2:
        raise ValueError(f"{field}: a target needs at least 2 decoder layers to have taps, got num_layers={num_layers}")
    out = list(taps)
    if not out:
        raise ValueError(f"{field}: at least one tap is required")
    for i, k in enumerate(out):
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(f"{field}[{i}] = {k!r}: a tap must be an integer")
        if not 1 <= k <= num_layers - 1:
            raise ValueError(
                f"{field}[{i}] = {k}: outside 1..{num_layers - 1} for a {num_layers}-layer target "
                "(tap k is the output of layer k counting from 1; tap 0 is the embedding and tap "
                f"{num_layers} the pre-norm last hidden state, neither is a tap)"
            )
    if out != sorted(set(out)):
        raise ValueError(f"{field}: {out} must be strictly ascending")
    return out


def _zero_based_to_taps(ids: Sequence[int], num_layers: int, field: str) -> list[int]:
    for i, j in enumerate(ids):
        if isinstance(j, bool) or not isinstance(j, int):
            raise ValueError(f"{field}[{i}] = {j!r}: a layer id must be an integer")
        if not 0 <= j <= num_layers - 2:
            raise ValueError(
                f"{field}[{i}] = {j}: outside 0..{num_layers - 2} for a {num_layers}-layer target "
                "(0-based index of the layer whose output is taken)"
            )
    return validate_taps([j + 1 for j in ids], num_layers, field=field)


def taps_from_dflash_target_layer_ids(
    ids: Sequence[int], num_layers: int, *, field: str = "dflash_config.target_layer_ids"
) -> list[int]:
    """DFlash/DSpark `target_layer_ids` (0-based layer outputs) to our taps: id + 1."""
    return _zero_based_to_taps(ids, num_layers, field)


def taps_to_dflash_target_layer_ids(
    taps: Sequence[int], num_layers: int, *, field: str = "hidden_states.taps"
) -> list[int]:
    """Our taps to DFlash/DSpark `target_layer_ids`: tap - 1."""
    return [k - 1 for k in validate_taps(taps, num_layers, field=field)]


def taps_from_sglang_aux_layer_ids(
    ids: Sequence[int], num_layers: int, *, field: str = "sglang.aux_hidden_states_layers"
) -> list[int]:
    """SGLang-native 0-based aux layer ids to our taps: [1, 45, 89] -> [2, 46, 90]."""
    return _zero_based_to_taps(ids, num_layers, field)


def taps_to_sglang_aux_layer_ids(
    taps: Sequence[int], num_layers: int, *, field: str = "hidden_states.taps"
) -> list[int]:
    """Our taps to SGLang-native 0-based aux layer ids: [2, 46, 90] -> [1, 45, 89]."""
    return [k - 1 for k in validate_taps(taps, num_layers, field=field)]


def taps_from_vllm_aux_ids(
    ids: Sequence[int], num_layers: int, *, field: str = "eagle_aux_hidden_state_layer_ids"
) -> list[int]:
    """vLLM/TokenSpeed EAGLE-3 aux ids are already our taps; only validated."""
    return validate_taps(ids, num_layers, field=field)


def taps_to_vllm_aux_ids(taps: Sequence[int], num_layers: int, *, field: str = "hidden_states.taps") -> list[int]:
    """Our taps as vLLM/TokenSpeed EAGLE-3 `eagle_aux_hidden_state_layer_ids` (the same numbers)."""
    return validate_taps(taps, num_layers, field=field)
