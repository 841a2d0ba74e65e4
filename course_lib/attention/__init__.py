"""The algorithm in NumPy and PyTorch: reference attention, online softmax, the tiled
forward and backward, masks, decoding, GQA, FP8 emulation and the cost models.
"""
