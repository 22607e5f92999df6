"""torchherd: run one PyTorch training job across many machines as easily as on one.

The launcher side (this package minus ``torchherd.train``) never imports torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
