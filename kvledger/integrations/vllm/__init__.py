"""kvledger as vLLM's offload store, through vLLM 0.33's OffloadingConnector.

Turn it on with one flag::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "KvledgerOffloadingSpec",
        "spec_module_path": "kvledger.integrations.vllm.spec",
        "cpu_bytes_to_use": 8000000000, "log_url": "sqlite:///kvledger-vllm.db"}}'

The scheduler side is ``manager.KvledgerOffloadingManager``; the worker side is
``worker.KvledgerOffloadingWorker``.
"""
