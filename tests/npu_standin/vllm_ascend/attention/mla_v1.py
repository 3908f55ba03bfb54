"""`AscendMLABackend` / `AscendMLAImpl` as names only (the adapter subclasses them)."""


class AscendMLAImpl:
    pass


class AscendMLABackend:
    @staticmethod
    def get_impl_cls():
        return AscendMLAImpl
