"""The mesh layer: peers propose work, a coordinator decides, completions carry commit SHAs.
Imports `bus`, never `observers`; the protocol arrives with the mesh issue."""
