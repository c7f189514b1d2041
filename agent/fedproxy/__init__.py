"""FedProxy: proxy compression, H-TIES, PCR, the owner's cohort rounds and its members."""
