"""What the tests need to check that, with libtpu installed on a host without TPU chips,
commands print no libtpu initialisation errors (focus_jax keeps JAX from starting its TPU
backend there). Checked in the subprocesses of other tests, run as a user runs them
(JAX_PLATFORMS unset, where the tests' conftest sets it to cpu), each one process start fewer
than a run of its own:

- ``focus-jax generate``: tests/test_compilation.py
  (test_the_bundled_models_answer_is_the_same_with_the_cache_empty_warm_or_off, its three runs);
- ``focus-jax compile-check``: tests/test_compile_check.py
  (test_the_compile_check_command_prints_its_table_and_nothing_else_and_leaves_the_cache_alone,
  its two runs, which check the persistent cache too).
"""

# What libtpu prints when it starts without a TPU (libtpu 0.0.48.1).
LIBTPU_ERRORS = ("Failed to find host bounds", "unexpected worker hostname",
                 "Source Location Trace", "TPU_ACCELERATOR_TYPE")


def tpu_chips() -> int:
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0]
