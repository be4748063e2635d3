import sys,json
for l in sys.stdin:
    try: d=json.loads(l)
    except Exception: print(l.strip()[:300]); continue
    print(d['geometry'], d['changed'], 'bw', round(d['copy_bandwidth_GBs']), 'B1', round(d['graph_replay_us'],2), round(d['graph_replay_roofline_ratio'],3), d['verify_replay_over_decode'], 'B64', round(d.get('B64_graph_replay_us',0),1), round(d.get('B64_roofline_ratio',0),3), 'B256', round(d.get('B256_graph_replay_us',0),1), round(d.get('B256_roofline_ratio',0),3), 'pub', round(d['public_call_back_to_back_us'],1), d.get('programmatic_unavailable'))
