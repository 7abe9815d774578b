"""The canonical model every layout reads into and every target encodes from, and each module's precision."""
