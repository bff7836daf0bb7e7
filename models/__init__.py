"""Model zoo: PyTorch definitions (``models.zoo``), the builder script and ``onnx/`` files."""
