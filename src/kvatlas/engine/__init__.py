"""kvatlas.engine"""
