"""The vector mirror: embeddings and vector stores that make every event recallable by meaning."""
