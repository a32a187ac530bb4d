/**
 * The dashboard's data: the last hour of each GPU as GET {base}/gpushare/history answers it
 * (gpushare_ext.protocol.GpuHistory), and the reading of it the charts need (the lease
 * spans as a band per user, packed into lanes; the memory columns stacked).
 *
 * It only fetches and reshapes: no drawing, no timers. Names and labels arrive anonymised
 * and as plain text from the broker; nothing here turns them into markup.
 */
import { ServerConnection } from '@jupyterlab/services';

import { groupSpans } from '../../gpushare_ext/widgets/occupancy.js';
import type { TimelineRow, TimelineSpan } from '../../gpushare_ext/widgets/occupancy.js';
import { requestAPI } from './api';

/** What one user held on a GPU over time, of one kind, in MiB (one value per sample). */
export interface IMemorySeries {
  user: string;
  own: boolean;
  kind: 'leased' | 'outside' | 'parked';
  mib: number[];
}

/** A lease on the dashboard's timeline: a timeline span with its label (yours only). */
export interface IHistorySpan extends TimelineSpan {
  label?: string;
}

export interface IDeviceHistory {
  index: number;
  name: string;
  memory_total_mib: number;
  times: number[];
  utilization_pct: number[];
  queued: number[];
  memory: IMemorySeries[];
  spans: IHistorySpan[];
}

export interface IGpuHistory {
  time: number;
  window_s: number;
  sample_every_s: number;
  you: string;
  is_admin: boolean;
  devices: IDeviceHistory[];
}

/** The last hour of every GPU, for this user. */
export function fetchHistory(settings?: ServerConnection.ISettings): Promise<IGpuHistory> {
  return requestAPI<IGpuHistory>('history', {}, settings);
}

/** A request's bar on the lease chart: its row, and the lane (of the whole chart) it sits in. */
export interface ILaneBar {
  row: TimelineRow & { label?: string };
  lane: number;
}

/**
 * One user's band of the lease chart: their requests in view, each in the first of the
 * user's lanes free at its start, so that a band is as tall as the most requests the
 * user held at once, and a lane holds requests that never overlap.
 */
export interface IUserBand {
  user: string;
  own: boolean;
  /** The band's first lane, counted over the whole chart from the top. */
  firstLane: number;
  lanes: number;
  bars: ILaneBar[];
}

/**
 * The spans of one GPU as bands, one per user, for the time from `from` to `to`: a gang's
 * ranks are one request (groupSpans), requests wholly outside that time are left out,
 * and your own band comes first, then the others by name.
 */
export function userBands(
  spans: IHistorySpan[],
  now: number,
  from: number,
  to: number
): IUserBand[] {
  const shown = groupSpans(spans)
    .filter(row => row.start <= to && (row.end ?? now) >= from)
    .sort((a, b) => a.start - b.start);
  const byUser = new Map<string, typeof shown>();
  for (const row of shown) byUser.set(row.user, [...(byUser.get(row.user) ?? []), row]);
  const users = [...byUser.keys()].sort((a, b) => {
    const ownA = byUser.get(a)![0].own;
    const ownB = byUser.get(b)![0].own;
    return ownA === ownB ? a.localeCompare(b) : ownA ? -1 : 1;
  });
  const bands: IUserBand[] = [];
  let firstLane = 0;
  for (const user of users) {
    const rows = byUser.get(user)!;
    const laneEnds: number[] = [];
    const bars = rows.map(row => {
      let lane = laneEnds.findIndex(laneEnd => laneEnd <= row.start);
      if (lane < 0) {
        lane = laneEnds.length;
        laneEnds.push(row.end ?? now);
      } else {
        laneEnds[lane] = row.end ?? now;
      }
      return { row, lane: firstLane + lane };
    });
    bands.push({ user, own: rows[0].own, firstLane, lanes: laneEnds.length, bars });
    firstLane += laneEnds.length;
  }
  return bands;
}

/** The memory columns stacked bottom up (leased, then outside, then parked). */
export function stackMemory(memory: IMemorySeries[], samples: number): number[][] {
  const stacked: number[][] = [];
  let below = new Array<number>(samples).fill(0);
  for (const series of memory) {
    const total = below.map((value, i) => value + (series.mib[i] ?? 0));
    stacked.push(total);
    below = total;
  }
  return stacked;
}
