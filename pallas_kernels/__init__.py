"""Kernels for focus_jax. Each op is a package: a pure-jnp ``reference`` (the ground truth, runs
everywhere), backend kernels, and one dispatch function that picks by platform with an explicit
``impl=`` override."""
