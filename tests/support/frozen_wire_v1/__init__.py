"""FROZEN. NEVER EDIT ANY FILE OF THIS PACKAGE (this one included).

A copy of kvatlas' wire as its first release spoke it (commit 5277bc7; every wire at
version 1): the msgspec Structs and constants of the P2P control channel
(`p2p_proto`), the engine API (`engine_proto`), event bodies and Kafka batch records
(`events`), the tcp data plane's request (`tcp_frame`), and the core shapes they carry
(`shapes`), with the codec they were decoded with (`codec`). Only what the bytes are
is copied: no behaviour beyond encoding and decoding.

It exists so that a change of today's wire cannot break an old node silently: the
mixed-fleet test (`tests/upgrade`) runs one server whose wire modules are these, and the
unit tests there decode this package's bytes with today's code and today's bytes with
this package. When a test that uses it fails, the change broke version N-1: change the
new code, never this copy. A later release that drops version 1 freezes its own oldest
version beside this package and retires this one with the tests that use it.
"""
