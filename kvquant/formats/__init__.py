"""The cache formats: how keys and values are stored, value for value (measuring code, hashed whole).

- :mod:`.ops` pure tensor arithmetic (integer codes, bit packing, fp8 casts, SQNR, rotations)
- :mod:`.roles` the storage role of each tensor a codec stores, and the fused kernels' stream kinds
- :mod:`.quantizers` the codec and quantizer base classes, the registry; :mod:`.research` kvquant's research formats
  (int8/int4/int2, fp8 e4m3/e5m2, the fp16 baseline)
- :mod:`.vllm` and :mod:`.sglang` the serving engines' formats (vLLM's ``--kv-cache-dtype`` values, SGLang's mxfp8),
  :mod:`.engine_math` the arithmetic they share
- :mod:`.kernels` the optional C++ kernel (``csrc/dequant.cpp``): one-pass dequantization, fused decode attention
- :mod:`.lowbit` low-bit research formats: Lloyd-Max and normal-float codebooks, dense-and-sparse outliers, a key
  offset
- :mod:`.llamacpp` llama.cpp's cache types (q8_0, q4_0, ...), its rotation and its query arithmetic;
  :mod:`.llamacpp_gguf` and :mod:`.llamacpp_matmuls` what llama.cpp does with a GGUF model that transformers does
  not (K's channel order; the activations of the weights' matmuls)
- :mod:`.keys_values` ``keys_values``: the keys stored by one registered quantizer, the values by another
"""
