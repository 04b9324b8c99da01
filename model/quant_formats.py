"""The weight quantisation formats by name (no JAX: serving/config.py validates options with them)."""

QUANTIZATIONS = ("int8", "fp8", "w8a8_fp8", "w8a8_fp8_rtn", "w8a8_int8", "int4_awq", "int4_gptq", "int4_rtn")
CALIBRATED_QUANTIZATIONS = ("fp8", "w8a8_fp8", "w8a8_int8", "int4_awq", "int4_gptq")  # the ones calibration_file feeds
