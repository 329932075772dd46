"""Writers of quantized artifacts."""
