"""Feature noise: EAGLE's training-time augmentation of the target features the drafter reads.

At serving time the drafter reads features of text it never trained on; uniform noise on the training
features keeps it from keying on their exact values (EAGLE adds U(-0.1, 0.1) to its single feature). The taps
of a deep target differ in scale by orders of magnitude (outliers up to ~1e4), so the noise here is relative:
each tap at each position gets U(-scale, scale) times its own RMS, the same size after the fusion's per-tap
RMSNorm whatever the tap's scale.

Shape legend: B batch, S sequence, N taps, Ht target width, F = N * Ht.
"""

import torch


def feature_noise(features_BSF: torch.Tensor, num_taps: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    """`features_BSF` `[B, S, F]` plus relative uniform noise; unchanged when `scale` is 0.

    The noise is drawn on the features' device from a seed taken from `generator` (which may live on
    the CPU), so a step re-seeded with the same value draws the same noise.
    """
    if scale == 0.0:
        return features_BSF
    B, S, F = features_BSF.shape
    taps = features_BSF.float().reshape(B, S, num_taps, F // num_taps)
    rms = taps.pow(2).mean(-1, keepdim=True).sqrt()
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    device_gen = torch.Generator(device=features_BSF.device).manual_seed(seed)
    unit = torch.rand(taps.shape, generator=device_gen, device=features_BSF.device, dtype=taps.dtype)
    noisy = taps + (unit * 2.0 - 1.0) * scale * rms
    return noisy.reshape(B, S, F).to(features_BSF.dtype)
