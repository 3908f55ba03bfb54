"""Stand-in for vllm-ascend's module layout (vllm-project/vllm-ascend `vllm_ascend/platform.py`,
`vllm_ascend/attention/mla_v1.py`): just the names the mla-ops adapter touches, so the adapter's
registration and its route decision run on CPU. No attention is computed here."""
