"""Operator tools that read a home without running a node: `epibus doctor` (doctor, doctor_local) and the generated
documents: the AsyncAPI description and the wire format's worked example."""
