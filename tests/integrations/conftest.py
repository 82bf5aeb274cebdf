"""The vLLM harness and end-to-end test import vLLM: they run in the vLLM test venv
(test_vllm_offloading.py starts them there), never in this suite's interpreter."""

collect_ignore = ["vllm_harness", "vllm_e2e"]
