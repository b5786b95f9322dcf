"""kvatlas.server"""
