"""Plug-ins that let inference engines use kvledger as their offload store (vLLM, SGLang).

Each subpackage imports its engine, so import it only where that engine is installed.
"""
