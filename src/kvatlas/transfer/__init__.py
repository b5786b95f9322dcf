"""kvatlas.transfer"""
