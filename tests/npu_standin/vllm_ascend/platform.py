"""`NPUPlatform.get_attn_backend_cls` as vllm-ascend has it: a classmethod returning class paths."""

ASCEND_MLA = "vllm_ascend.attention.mla_v1.AscendMLABackend"
ASCEND_ATTN = "vllm_ascend.attention.attention_v1.AscendAttentionBackend"


class NPUPlatform:
    device_name = "npu"
    device_type = "npu"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        return ASCEND_MLA if attn_selector_config.use_mla else ASCEND_ATTN
