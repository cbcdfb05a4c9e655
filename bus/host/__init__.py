"""What a node keeps on its machine: the 0700 home and its 0600 files (home), the embedded nats-server, its
configuration, routes and TLS files (server, routes, tls), and the guards that keep one server per store
directory and let no child outlive its parent (server_guard, processes, ports).

Imports: model."""
