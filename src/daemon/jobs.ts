/**
 * The registry of jobs (protocol version 3, docs/protocol.md "Jobs"): which sessions belong to which job, each job's
 * settings (codec, SM budget) and the daemon's, and per job and stream the requests, bytes, seconds and errors.
 *
 * A job is a name: every session whose `hello` or `job` op gave that name belongs to it (the ranks of one training
 * run); a session that gave none is listed under its hello `name`, else `pid-<pid>`. A job whose last session ended
 * stays listed ("ended") for {@link ENDED_JOB_KEEP_MS}, with its counters and settings: a client that reconnects
 * within that time (a lapsed lease, a new session after an error) finds its job as it left it.
 *
 * Settings: a job's codec (`fast`/`max`/`auto`/`off`) replaces the codec of every tensor its sessions compress
 * (`off`: `raw` frames); the daemon's codec does so for jobs with no codec of their own. A job's SM budget replaces
 * what its requests ask; the daemon's is the budget of requests that name none. Each takes effect at the next request:
 * a ZeroMQ request reads them when it arrives ({@link JobRegistry.apply}), a ring's thread from the moment the daemon
 * hands them over ({@link JobRegistry.ringSettings}; server.ts does so when they change and when a ring opens).
 */
import { userInfo } from 'node:os';
import type { Codec, RingSettings } from '../native.js';
import { ReplyError } from './reply-error.js';
import { SM_BUDGET_DEFAULT } from '../generated/constants.js';
import { STREAMS, type JobInfo, type SettingCodec, type StreamName } from './schema.js';
import type { Session } from './session.js';

/** How long a job is listed after its last session ended, ms. */
export const ENDED_JOB_KEEP_MS = 60_000;
/** The addon's SM budget of a GPU call that names none (src/native.ts, GpuRunOptions.smBudget). */
export const ADDON_SM_BUDGET = SM_BUDGET_DEFAULT;
/** Pids remembered per job at most (a job's processes over its lifetime; the oldest are forgotten). */
const MAX_PIDS = 1024;
/** Ranks remembered per job at most (a session may name a new rank at every `job` op; the oldest are forgotten). */
const MAX_RANKS = 1024;
/**
 * Ended jobs listed at most: beyond, the one that ended first is dropped before its keep time (a client renaming its
 * job after every request would otherwise grow the registry for a minute; live jobs are bounded by the sessions).
 */
export const MAX_ENDED_JOBS = 1024;
/** Job names an unknown job's error message lists at most. */
const LISTED_IN_ERRORS = 10;

/** Settings of a job or of the daemon; null: not set (a job's: the daemon's applies; the daemon's: the request's). */
export interface Settings {
  codec: SettingCodec | null;
  smBudget: number | null;
}

/** What a request runs with after the settings: the codec for every tensor (undefined: the request's own) and the SM budget. */
export interface AppliedSettings {
  codec: Codec | undefined;
  smBudget: number | undefined;
}

/** Counters of one direction of one stream. */
export interface DirectionCounters {
  /** Requests answered without error. */
  requests: number;
  /** Tensors (compress) or frames (decompress). */
  items: number;
  /** Bytes read: tensor bytes (compress), frame bytes (decompress). */
  bytesIn: number;
  /** Bytes written: frame bytes (compress), tensor bytes (decompress). */
  bytesOut: number;
  /** Seconds from a request's start to its reply, summed over requests. */
  seconds: number;
}

/** Counters of one stream of a job. */
export interface StreamCounters {
  compress: DirectionCounters;
  decompress: DirectionCounters;
  /** compress/decompress requests answered with an error. */
  errors: number;
}

function directionCounters(): DirectionCounters {
  return { requests: 0, items: 0, bytesIn: 0, bytesOut: 0, seconds: 0 };
}

/** One job: its sessions, what they said about it, its settings and counters. */
export class Job {
  readonly sessions = new Set<Session>();
  readonly settings: Settings = { codec: null, smBudget: null };
  readonly streams = Object.fromEntries(STREAMS.map((s) => [s, { compress: directionCounters(), decompress: directionCounters(), errors: 0 }])) as Record<StreamName, StreamCounters>;
  /** Pids of its sessions, live and ended (insertion order: the oldest first). */
  readonly pids = new Set<number>();
  readonly devices = new Set<string>();
  readonly ranks = new Set<number>();
  user: string | null = null;
  worldSize: number | null = null;
  /** Whether its processes are MPS clients: true when a live session says so, else the last word of its sessions. */
  mps: boolean | null = null;
  /** When its last session ended (ms since the epoch), or null while it has sessions. */
  endedAt: number | null = null;
  /** compress/decompress requests answered, errors included. */
  requests = 0;

  constructor(readonly name: string) {}

  /** Whether a session of the job is attached. */
  get attached(): boolean {
    for (const s of this.sessions) if (s.attached) return true;
    return false;
  }

  /** When the earliest attached session attached (ms since the epoch), or null when none is attached. */
  get attachedAt(): number | null {
    let at: number | null = null;
    for (const s of this.sessions) if (s.attachedAt !== null && (at === null || s.attachedAt < at)) at = s.attachedAt;
    return at;
  }

  /** Adds what `session` says (its pid, its job info). */
  note(session: Session): void {
    this.pids.delete(session.pid);
    this.pids.add(session.pid);
    if (this.pids.size > MAX_PIDS) this.pids.delete(this.pids.values().next().value as number);
    const info = session.job;
    if (info === null) return;
    if (info.user !== undefined) this.user = info.user;
    if (info.rank !== undefined) {
      this.ranks.delete(info.rank);
      this.ranks.add(info.rank);
      if (this.ranks.size > MAX_RANKS) this.ranks.delete(this.ranks.values().next().value as number);
    }
    if (info.world_size !== undefined) this.worldSize = info.world_size;
    for (const d of info.devices ?? []) if (this.devices.size < 256) this.devices.add(d);
    if (info.mps !== undefined) {
      let live = false;
      for (const s of this.sessions) if (s.job?.mps === true) live = true;
      this.mps = live ? true : info.mps;
    }
  }
}

/** Settings as the wire writes them (`settings: {codec, sm_budget}`). */
export function wireSettings(s: Settings): { codec: SettingCodec | null; sm_budget: number | null } {
  return { codec: s.codec, sm_budget: s.smBudget };
}

/** The registry of a daemon's jobs and its own settings. */
export class JobRegistry {
  /** The daemon's settings (`set` without a job). */
  readonly daemonSettings: Settings = { codec: null, smBudget: null };
  /**
   * What the daemon's settings go back to when `set` clears one (null): those it started with (`tzip serve
   * --sm-budget`, its configuration), not the addon's.
   */
  readonly startSettings: Settings = { codec: null, smBudget: null };
  private readonly byName = new Map<string, Job>();
  private readonly ofSession = new Map<Session, Job>();
  private readonly defaultUser: string;

  constructor(private readonly keepMs: number = ENDED_JOB_KEEP_MS) {
    let user = '';
    try {
      user = userInfo().username;
    } catch {
      user = String(process.getuid?.() ?? '');
    }
    this.defaultUser = user;
  }

  /**
   * The name of the job `session` belongs to. A hello `name` (free text since protocol version 1) naming the job has its
   * control characters replaced by U+FFFD, as a job's own name may have none (schema.ts, printableName).
   */
  static jobNameOf(session: Session): string {
    return session.job?.name ?? (session.name !== '' ? session.name.replace(/\p{Cc}/gu, '\ufffd') : `pid-${session.pid}`);
  }

  /** The job of a live session (undefined for one not {@link join}ed). */
  jobOf(session: Session): Job | undefined {
    return this.ofSession.get(session);
  }

  /** The job named `name`, live or ended, or undefined. */
  get(name: string): Job | undefined {
    return this.byName.get(name);
  }

  /**
   * Puts `session` in the job its job info (or hello name) names, leaving the job it was in: at hello, and again
   * after the `job` op changed its info.
   */
  join(session: Session, now: number = Date.now()): Job {
    const name = JobRegistry.jobNameOf(session);
    const old = this.ofSession.get(session);
    if (old !== undefined && old.name !== name) this.leave(session, now, true);
    let job = this.byName.get(name);
    if (job === undefined) {
      job = new Job(name);
      this.byName.set(name, job);
    }
    job.sessions.add(session);
    job.endedAt = null;
    job.note(session);
    this.ofSession.set(session, job);
    return job;
  }

  /** Takes `session` out of its job: it ended, or (`moving`) it named another job. */
  leave(session: Session, now: number = Date.now(), moving = false): void {
    const job = this.ofSession.get(session);
    if (job === undefined) return;
    this.ofSession.delete(session);
    job.sessions.delete(session);
    if (job.sessions.size > 0) return;
    // The job a session was listed under before it named its own (its hello name), left without a request or a
    // setting: nothing to show, so it is not listed as ended.
    if (moving && job.requests === 0 && job.settings.codec === null && job.settings.smBudget === null) {
      this.byName.delete(job.name);
      return;
    }
    job.endedAt = now;
    let ended = 0;
    let first: Job | undefined;
    for (const j of this.byName.values()) {
      if (j.endedAt === null) continue;
      ended++;
      if (first === undefined || j.endedAt < (first.endedAt as number)) first = j;
    }
    if (ended > MAX_ENDED_JOBS && first !== undefined) this.byName.delete(first.name);
  }

  /** Live and recently ended jobs, ended ones older than the keep time dropped first. */
  all(now: number = Date.now()): Job[] {
    this.prune(now);
    return [...this.byName.values()];
  }

  /** Drops jobs ended more than the keep time ago. */
  prune(now: number = Date.now()): void {
    for (const [name, job] of this.byName) {
      if (job.endedAt !== null && now - job.endedAt > this.keepMs) this.byName.delete(name);
    }
  }

  /** Jobs with a live session. */
  get liveCount(): number {
    let n = 0;
    for (const job of this.byName.values()) if (job.sessions.size > 0) n++;
    return n;
  }

  /** The user a job is listed with. */
  userOf(job: Job): string {
    return job.user ?? this.defaultUser;
  }

  /** The settings that apply to a job's requests: its own where set, else the daemon's. */
  effective(job: Job | undefined): Settings {
    return {
      codec: job?.settings.codec ?? this.daemonSettings.codec,
      smBudget: job?.settings.smBudget ?? this.daemonSettings.smBudget,
    };
  }

  /**
   * What a request of `session` runs with: the codec for every tensor when its job (or the daemon) sets one (`off`:
   * `raw`), and the SM budget: the job's, else the request's `sm_budget`, else the daemon's (undefined: the addon's).
   */
  apply(session: Session, requestSmBudget: number | undefined): AppliedSettings {
    const job = this.ofSession.get(session);
    const codec = job?.settings.codec ?? this.daemonSettings.codec;
    const smBudget = job?.settings.smBudget ?? requestSmBudget ?? this.daemonSettings.smBudget ?? undefined;
    return { codec: codec === null ? undefined : codec === 'off' ? 'raw' : codec, smBudget };
  }

  /**
   * What the rings of `session` apply to every SQE (docs/ring.md, "Who applies the job's settings"), as
   * {@link apply} for its ZeroMQ requests: the codec its job (or the daemon) sets, for every compress SQE (`off`:
   * `raw`); the job's SM budget over every SQE's; for SQEs that give none, `ringSmBudget` (their ring_open's), else
   * the daemon's, else the addon's.
   */
  ringSettings(session: Session, ringSmBudget: number | undefined): RingSettings {
    const job = this.ofSession.get(session);
    return {
      codec: this.apply(session, undefined).codec ?? null,
      smBudgetOverride: job?.settings.smBudget ?? null,
      smBudget: ringSmBudget ?? this.daemonSettings.smBudget ?? ADDON_SM_BUDGET,
    };
  }

  /**
   * The `set` op: changes a job's settings (`job`) or the daemon's; an absent field is kept, null clears it.
   * @returns the job's name (null: the daemon's) and the settings that now apply to it.
   * @throws ReplyError TZIP_USAGE for a job not listed (the message lists the jobs).
   */
  set(jobName: string | undefined, patch: { codec?: SettingCodec | null | undefined; sm_budget?: number | null | undefined }): { job: string | null; settings: Settings } {
    let target: Settings;
    let job: Job | undefined;
    if (jobName !== undefined) {
      this.prune();
      job = this.byName.get(jobName);
      if (job === undefined) {
        // The latest jobs first, at most LISTED_IN_ERRORS of them: the registry may hold a thousand ended jobs.
        const names = [...this.byName.keys()].reverse();
        const shown = names.slice(0, LISTED_IN_ERRORS).map((n) => JSON.stringify(n)).join(', ');
        const more = names.length > LISTED_IN_ERRORS ? ` and ${names.length - LISTED_IN_ERRORS} more (tzip jobs lists them)` : '';
        throw new ReplyError('TZIP_USAGE', `no job named ${JSON.stringify(jobName)}; the daemon lists ${names.length === 0 ? 'no job' : shown + more}`);
      }
      target = job.settings;
    } else {
      target = this.daemonSettings;
    }
    // A job's cleared setting falls back to the daemon's; the daemon's to what it started with.
    const cleared = jobName !== undefined ? { codec: null, smBudget: null } : this.startSettings;
    if (patch.codec !== undefined) target.codec = patch.codec ?? cleared.codec;
    if (patch.sm_budget !== undefined) target.smBudget = patch.sm_budget ?? cleared.smBudget;
    return { job: job?.name ?? null, settings: jobName !== undefined ? this.effective(job) : { ...this.daemonSettings } };
  }

  /**
   * Counts one answered compress/decompress request of `session`: on success its items, bytes and seconds, else
   * one error, under `stream` (absent: `other`).
   */
  record(session: Session, op: 'compress' | 'decompress', stream: StreamName | undefined,
    r: { seconds: number; items: number; bytesIn: number; bytesOut: number; error: string | null }): void {
    // A session that ended while the request ran (its socket went away) has left its job: count it there by name.
    const job = this.ofSession.get(session) ?? this.byName.get(JobRegistry.jobNameOf(session));
    if (job === undefined) return;
    job.requests++;
    const s = job.streams[stream ?? 'other'];
    if (r.error !== null) {
      s.errors++;
      return;
    }
    const d = s[op];
    d.requests++;
    d.items += r.items;
    d.bytesIn += r.bytesIn;
    d.bytesOut += r.bytesOut;
    d.seconds += r.seconds;
  }
}
