"""Speculative decoding: drafters, verification and KDA state rollback."""
