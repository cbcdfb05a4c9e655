"""An identity's key: making, loading and using the ed25519/nkey an agent or node signs with, signing and
verifying events and requests (signing), and what a connection's key may reach (confinement).

Imports: model, host."""
