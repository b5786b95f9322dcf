"""kvatlas.coordinator"""
