"""The mesh layer: peers propose work, a coordinator decides, completions carry commit SHAs (DESIGN §8).
Imports `bus`, never `observers`; the protocol arrives with the mesh issue."""
