"""What every test suite shares, importable as ``support`` (pytest puts tests/ on
sys.path; see ``tests/conftest.py``).

- ``wait``: the one wait (poll an observable condition until it holds).
- ``launch``: the one process launcher (log captured, wait until it answers, stop by pid).
- ``services``: the coordinator and cache server started through their CLIs.
- ``coordinator``: the real coordinator served from a thread of the test process.
- ``kafka``: the real tansu Kafka-protocol broker.
- ``tap``: a loopback forwarder that records the HTTP requests passing to a real server.

Must not: hold fakes of kvatlas components; tests run the real ones.
"""
