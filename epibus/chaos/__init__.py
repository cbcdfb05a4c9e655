"""`epibus chaos`: run a workload against a node or the one-machine cluster, inject real faults on a schedule,
let the system settle, then audit every store for acknowledged events that were lost, duplicated or changed."""
