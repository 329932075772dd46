"""The bottom layer beside ``qtool.quant``: files. Safetensors reading (checkpoint discovery, header checks,
one tensor at a time) and streaming writing, atomic output directories, hashing, sizes. No torch.nn, no models."""
