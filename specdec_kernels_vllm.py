"""The vLLM entry point of specdec_kernels (``vllm.general_plugins``), kept apart from the
package so that loading it cannot fail: vLLM logs an entry point that fails to import and
runs without it, which would leave the plugin silently off.  Importing the package happens in
``register()``, whose errors vLLM does not catch.  See specdec_kernels.integrations.vllm."""


def register() -> None:
    """Switch the plugin on in this vLLM process when ``SPECDEC_VLLM=1`` (see
    ``specdec_kernels.integrations.vllm.register``)."""
    import os

    # the off values of specdec_kernels.integrations.vllm.enabled_by_env, repeated so that a
    # switched-off vLLM never imports the package; anything else goes on to its check
    if os.environ.get("SPECDEC_VLLM", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    from specdec_kernels.integrations.vllm import register as _register

    _register()
