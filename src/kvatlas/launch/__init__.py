"""Starting and stopping the processes of a fleet (services, engines, a Kafka-protocol
broker): shared by the demo, the evaluation, the benchmarks and the tests."""
