"""qtool: quantize PyTorch models with AIMET-exact affine numerics."""

__version__ = "0.1.0"

__all__ = ["__version__", "load_calibrated"]


def __getattr__(name):
    # keep `import qtool` light: the pipeline (and torch/transformers) load on first use
    if name == "load_calibrated":
        from .pipeline import load_calibrated

        return load_calibrated
    raise AttributeError(f"module 'qtool' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))  # (the lazy names too: tab completion and dir() list them)
