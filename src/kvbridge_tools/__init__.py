"""Tools that ship beside the kvbridge library, outside its import path: the demo workload
(`kvbridge demo`) and the benchmark matrix (`kvbridge bench`). They start processes, network
namespaces and plots; `import kvbridge` never loads them."""
