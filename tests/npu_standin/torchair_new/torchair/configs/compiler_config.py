"""CompilerConfig's shape: mode and experimental_config options (Ascend/torchair python/torchair/configs)."""
import types


class CompilerConfig:
    def __init__(self):
        self.mode = "max-autotune"  # torchair's default: GE
        self.experimental_config = types.SimpleNamespace(frozen_parameter=False, tiling_schedule_optimize=False)
