"""EAGLE-3 feature noise: relative to each tap's scale, reproducible from the step's seed, off at 0."""

import pytest
import torch

from draftsmith.core.config import Eagle3Config
from draftsmith.drafters.eagle3.noise import feature_noise

pytestmark = pytest.mark.unit


def _features(scales: list[float]) -> torch.Tensor:
    """`[2, 5, N*8]` features whose taps differ in scale as given."""
    g = torch.Generator().manual_seed(0)
    taps = [torch.randn(2, 5, 8, generator=g) * s for s in scales]
    return torch.cat(taps, dim=-1)


def test_zero_scale_returns_the_features_untouched_and_draws_nothing():
    feats, g = _features([1.0, 100.0]), torch.Generator().manual_seed(3)
    assert feature_noise(feats, 2, 0.0, g) is feats
    assert (
        torch.randint(0, 10**9, (1,), generator=g).item()
        == torch.randint(0, 10**9, (1,), generator=torch.Generator().manual_seed(3)).item()
    )


def test_noise_is_bounded_by_each_taps_own_rms():
    scales = [1e-3, 1.0, 2.5e4]
    feats = _features(scales)
    out = feature_noise(feats, 3, 0.1, torch.Generator().manual_seed(1))
    delta = (out - feats).reshape(2, 5, 3, 8)
    rms = feats.reshape(2, 5, 3, 8).pow(2).mean(-1, keepdim=True).sqrt()
    rel = delta.abs() / rms
    assert rel.max() <= 0.1 + 1e-5
    # Every tap is perturbed at its own scale: not zero on the small tap, not huge on the large one.
    per_tap = rel.amax(dim=(0, 1, 3))
    assert torch.all(per_tap > 0.05), per_tap


def test_same_seed_same_noise_other_seed_other_noise():
    feats = _features([1.0, 3.0])
    a = feature_noise(feats, 2, 0.2, torch.Generator().manual_seed(7))
    b = feature_noise(feats, 2, 0.2, torch.Generator().manual_seed(7))
    c = feature_noise(feats, 2, 0.2, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_keeps_the_features_dtype():
    feats = _features([1.0, 2.0]).to(torch.bfloat16)
    assert feature_noise(feats, 2, 0.1, torch.Generator().manual_seed(0)).dtype == torch.bfloat16


def test_config_bounds_name_the_field():
    base = dict(num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=16, draft_vocab_size=32)
    assert Eagle3Config(**base).feature_noise == 0.0
    with pytest.raises(ValueError, match="feature_noise"):
        Eagle3Config(**base, feature_noise=-0.1)
