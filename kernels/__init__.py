"""TileLang kernels (KV block gather/scatter, quantisation) with torch reference versions."""
