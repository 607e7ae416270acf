"""runtime/transport"""
