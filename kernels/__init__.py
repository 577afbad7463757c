"""Triton kernels for the drafter-training hot spots, each beside its PyTorch reference.

- `head_loss`: fused output head + distillation loss (soft CE / forward KL, CE, L1, accuracies), in row chunks.
- `rms_norm`: RMSNorm over one or several equal segments of the last dim (EAGLE-3.1 / DSpark `fc_norm`).
- `dyn_conv`: DFlash2's dynamic depthwise convolution over block positions.

Dispatch (`kernels.dispatch`): Triton on CUDA, the reference elsewhere, Triton on CPU under TRITON_INTERPRET=1.
"""

# Only as `draftsmith.kernels`. A process started in the repository root (`python -c`, `python -m`) finds this
# folder as a top-level `kernels` too, the name of the Hugging Face package that transformers imports to probe
# for it; this is not that package, so under that name it stays an empty module the probe finds nothing in.
if __name__ == "draftsmith.kernels":
    from draftsmith.kernels.dispatch import choose, get_mode, set_mode, use
    from draftsmith.kernels.dyn_conv import dyn_conv
    from draftsmith.kernels.head_loss import HeadLossOut, Target, head_loss
    from draftsmith.kernels.rmsnorm import rms_norm


def source_modules() -> list:
    """The modules whose source keys the drafters' caches: dispatch, entry points, specs and references. The
    Triton modules are left out on purpose: importing them needs triton (absent on CPU installs, so keys would
    differ between machines), and the parity tests hold them to the references these keys follow."""
    import importlib
    import pkgutil

    names = [m.name for m in pkgutil.walk_packages(__path__, prefix=f"{__name__}.")]
    names = [n for n in names if not n.endswith((".triton_kernels", ".function"))]
    return [importlib.import_module(n) for n in sorted(names)]


__all__ = [
    "HeadLossOut",
    "Target",
    "choose",
    "dyn_conv",
    "get_mode",
    "head_loss",
    "rms_norm",
    "set_mode",
    "source_modules",
    "use",
]
