"""A JetStream cluster on one machine (`epibus cluster up`, local) and the Linux network namespaces that let chaos
partition its servers (netns)."""
