"""The observers layer: projections of the stream into durable, queryable stores. Imports `bus`, never `mesh`."""
