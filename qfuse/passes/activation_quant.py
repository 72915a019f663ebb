"""activation_quant: WIP"""
def run(graph, context):
    pass
